"""bench/bf16_offset.py checks itself on a CPU: without autocast every way runs in float32, so
each one's loss, final norm and adapter gradient must equal the float32 reference's (its
layer-by-layer backward included) to rounding, on a deepstack MoE family and on a hybrid
Gated-DeltaNet MoE family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import bench_module


@pytest.mark.parametrize("name", ["tiny-qwen3_vl_moe", "tiny-qwen3_5_moe"])
def test_every_way_equals_the_float32_reference_on_cpu(name: str, tmp_path: Path) -> None:
    bf16_offset = bench_module("bf16_offset")
    bf16_offset.main(["--recipe", "tiny", "--bins", "1", "--max-samples", "1", "--samples", "40",
                      "--out", str(tmp_path), f"model.name={name}", "model.lora.rank=8"])
    (row,) = json.loads((tmp_path / "bf16_offset.json").read_text())["samples"]
    assert row["float32_gradient"]["tensors"] == row["float32_gradient"]["of"] > 0
    for way in bf16_offset.WAYS:
        assert abs(row["loss"][way] - row["loss"]["float32"]) < 1e-5, way
        assert row["layers"][way][-1] < 1e-5, way
        assert row["gradient"][way]["relative"] < 1e-5, way
        assert row["gradient"][way]["cosine"] > 1 - 1e-6, way


def test_the_conv_way_runs_only_the_convolution_on_torch(monkeypatch) -> None:
    """`-conv` (vlpack's class with `conv_on_torch`) hands the short convolution `torch_only`
    and leaves the delta rule's choice alone; vlpack's own class hands neither. On a CPU both
    run torch either way, so the test reads the flags each kernel receives."""
    import torch

    from vlpack.data.batch import build_thd_batch
    from vlpack.model import gdn
    from vlpack.model.build import build_model
    from vlpack.model.forward import packed_forward
    from vlpack.model.synthetic import default_mix

    bf16_offset = bench_module("bf16_offset")
    seen = []
    conv, rule = gdn.segment_conv1d, gdn.segment_delta_rule
    monkeypatch.setattr(gdn, "segment_conv1d",
                        lambda *a, torch_only, **k: seen.append(("conv", torch_only))
                        or conv(*a, torch_only=torch_only, **k))
    monkeypatch.setattr(gdn, "segment_delta_rule",
                        lambda *a, torch_only, **k: seen.append(("rule", torch_only))
                        or rule(*a, torch_only=torch_only, **k))
    model, spec = build_model("tiny-qwen3_5_moe-1L", device="cpu", seed=0)
    batch = build_thd_batch(default_mix(spec, 2, seed=0), pad_token_id=spec.pad_token_id,
                            pad_to_multiple_of=1, mrope_after_video="transformers")
    with torch.no_grad():
        packed_forward(model, batch, spec=spec)
        assert seen == [("conv", False), ("rule", False)], seen
        seen.clear()
        with bf16_offset.stock_seams(model, ["conv"]):
            packed_forward(model, batch, spec=spec)
    assert seen == [("conv", True), ("rule", False)], seen
