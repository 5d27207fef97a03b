"""A preset (random weights) on the user's data is refused unless `model.init=random` says so;
the message names the published folder to download and how."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlpack.config import load_config


@pytest.mark.parametrize("source", ["jsonl", "energon"])
def test_a_real_size_preset_on_user_data_is_refused_with_the_download(source: str) -> None:
    with pytest.raises(ValueError) as e:
        load_config("qwen3-vl-2b", [f"data.source={source}", "data.path=my.jsonl"])
    msg = str(e.value)
    assert "model.name=qwen3-vl-2b is a preset" in msg and f"data.source={source}" in msg
    assert "hf download Qwen/Qwen3-VL-2B-Instruct --local-dir Qwen3-VL-2B-Instruct" in msg
    assert "model.name=Qwen3-VL-2B-Instruct" in msg and "model.init=random" in msg


def test_a_cut_preset_names_its_full_model_and_a_tiny_one_has_none() -> None:
    with pytest.raises(ValueError, match=r"hf download Qwen/Qwen3\.5-35B-A3B "):
        load_config(None, ["model.name=qwen3.5-35b-a3b-4L", "data.source=jsonl",
                           "data.path=my.jsonl"])
    with pytest.raises(ValueError, match=r"tiny-qwen3_vl is a test model with no published "
                                         r"weights.*model\.init=random"):
        load_config(None, ["data.source=jsonl", "data.path=my.jsonl"])


def test_random_init_a_folder_or_synthetic_data_are_accepted(tmp_path: Path) -> None:
    on_purpose = load_config("qwen3-vl-2b", ["data.source=jsonl", "data.path=my.jsonl",
                                             "model.init=random"])
    assert on_purpose.model.init == "random"
    assert load_config("qwen3-vl-2b").data.source == "synthetic"  # the built-in data: no refusal
    folder = load_config(None, ["data.source=jsonl", "data.path=my.jsonl",
                                f"model.name={tmp_path}"])
    assert folder.model.name == str(tmp_path)
