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
