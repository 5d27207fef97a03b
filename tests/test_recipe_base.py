"""A recipe's `base:`: the named recipe underneath, this file's keys on top, section by section."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlpack.config import load_config, read_recipe


def test_base_merges_section_by_section(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "model:\n  name: tiny-qwen3_vl\n  lora:\n    rank: 8\n    alpha: 16\n"
        "optim:\n  lr: 1.0e-4\n  betas: [0.9, 0.99]\ntrain:\n  max_steps: 7\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text(
        "base: ../a.yaml\nmodel:\n  lora:\n    alpha: 32\noptim:\n  betas: [0.8, 0.9]\ntrain:\n")
    assert read_recipe(tmp_path / "sub" / "b.yaml") == {
        "model": {"name": "tiny-qwen3_vl", "lora": {"rank": 8, "alpha": 32}},
        "optim": {"lr": 1e-4, "betas": [0.8, 0.9]}, "train": {"max_steps": 7}}


def test_base_by_recipe_name_equals_the_recipe_with_overrides(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("base: tiny\noptim:\n  lr: 1.0e-5\n")
    assert load_config(tmp_path / "mine.yaml") == load_config("tiny", ["optim.lr=1e-5"])


def test_shipped_twins_are_their_base_plus_their_differences() -> None:
    assert load_config("tiny-nopack") == load_config(
        "tiny", ["data.packing=none", "data.batch_size=4", "train.output_dir=runs/tiny-nopack"])
    assert load_config("qwen3-vl-8b-lora") == load_config(
        "qwen3-vl-8b", ["model.lora.rank=16", "model.lora.alpha=32", "optim.lr=2e-4",
                        "train.output_dir=runs/qwen3-vl-8b-lora"])


def test_a_loop_of_bases_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match=r"the base: recipes form a loop .*a\.yaml → .*b\.yaml → .*a\.yaml"):
        load_config(tmp_path / "a.yaml")


def test_a_missing_base_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: nosuch\n")
    with pytest.raises(ValueError, match=r"config nosuch is neither a YAML file nor a recipe; recipes: "):
        load_config(tmp_path / "a.yaml")
