"""Building a model from a checkpoint folder (model/build.py): its weights read, a config-only
folder refused unless random weights are asked for, and random weights that read none."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import hf_test_folder
from vlpack.model import build_model


def test_build_from_folder(tmp_path):
    model, spec = build_model("tiny-qwen3_vl", device="cpu")
    model.save_pretrained(tmp_path / "full")
    again, spec2 = build_model(str(tmp_path / "full"), device="cpu", seed=123)
    assert spec2.family == "qwen3_vl" and spec2.image_token_id == spec.image_token_id
    w = "model.language_model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(dict(model.named_parameters())[w], dict(again.named_parameters())[w])
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"config.json but no weights .*model.init=random"):
        build_model(str(tmp_path / "cfg"), device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_model(str(tmp_path / "cfg"), device="cpu", random_init=True)
    assert any("RANDOM" in str(w.message) for w in caught)


def test_init_random_reads_no_weights(tmp_path):
    """`random_init` on a folder that holds weights builds random ones of its config (seeded),
    not the saved ones."""
    import torch

    from vlpack.model.build import build_model

    folder = hf_test_folder(tmp_path / "w", "qwen3_vl")
    saved, _ = build_model(str(folder), device="cpu", dtype="float32")
    rand, _ = build_model(str(folder), device="cpu", dtype="float32", random_init=True, seed=1)
    again, _ = build_model(str(folder), device="cpu", dtype="float32", random_init=True, seed=1)
    name = "model.language_model.layers.0.mlp.gate_proj.weight"
    p = {n: dict(m.named_parameters())[name] for n, m in
         (("saved", saved), ("rand", rand), ("again", again))}
    assert not torch.equal(p["saved"], p["rand"]) and torch.equal(p["rand"], p["again"])
