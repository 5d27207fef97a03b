"""Model presets by name (model/presets.py): tiny presets with real token ids, real-size shapes,
cut-down depths, unknown names, and a preset on the user's data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vlpack.config import load_config
from vlpack.model import build_model
from vlpack.model.presets import PRESETS, get_preset, reduced_depth
from vlpack.preset_names import NAMES


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny-")])
def test_tiny_presets_use_real_token_ids(name):
    from vlpack.model.build import _spec, preset_config

    p = get_preset(name)
    cfg = preset_config(p)
    spec = _spec(name, cfg, "sdpa")
    if p.family.startswith("qwen3_5"):
        assert (spec.vocab_size, spec.image_token_id, spec.vision_start_token_id) == \
            (248320, 248056, 248053)
        assert {"linear_attention", "full_attention"} <= set(cfg.text_config.layer_types)
    else:
        assert (spec.vocab_size, spec.image_token_id, spec.vision_start_token_id,
                spec.vision_end_token_id, spec.video_token_id, spec.eos_token_id,
                spec.pad_token_id) == (151936, 151655, 151652, 151653, 151656, 151645, 151643)
    assert 2 <= cfg.text_config.num_hidden_layers <= 4 and cfg.text_config.hidden_size <= 128
    assert cfg.vision_config.depth == 2 and cfg.tie_word_embeddings
    if spec.is_moe:
        assert spec.num_experts >= 4


def test_real_presets_name_their_source():
    for name in ("qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-9b", "qwen3.5-35b-a3b"):
        assert get_preset(name).source


@pytest.mark.parametrize(("name", "billions"), [
    ("qwen3-vl-2b", 2.13), ("qwen3-vl-8b", 8.77), ("qwen3-vl-30b-a3b", 31.07),
    ("qwen3.5-35b-a3b", 35.11),
    # + its multi-token-prediction layer (0.24 B, not built) = the checkpoint's 9.65 B parameters
    # (19,306,216,416 bytes of bf16 in its safetensors index)
    ("qwen3.5-9b", 9.41),
])
def test_real_presets_build_on_meta(name, billions):
    """Shapes only (meta device); a guard on the preset shapes: totals fit the model names."""
    model, spec = build_model(name, device="meta", dtype="bfloat16")
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(total - billions) < 0.01, total
    assert spec.has_gdn == name.startswith("qwen3.5") and spec.is_moe == ("-a3b" in name)


def test_reduced_depth_keeps_the_shape_and_the_hybrid_pattern():
    """The benchmarks' cut-down 35B: 4 text layers (3 Gated-DeltaNet + 1 attention), same widths."""
    name = reduced_depth("qwen3.5-35b-a3b", 4)
    assert reduced_depth("qwen3.5-35b-a3b", 4) == name == "qwen3.5-35b-a3b-4L"
    model, spec = build_model(name, device="meta", dtype="bfloat16")
    text = model.config.text_config
    assert text.num_hidden_layers == len(model.model.language_model.layers) == 4
    assert list(text.layer_types) == ["linear_attention"] * 3 + ["full_attention"]
    full = get_preset("qwen3.5-35b-a3b").text
    assert text.hidden_size == full["hidden_size"] and text.num_experts == full["num_experts"]
    assert spec.has_gdn and spec.is_moe
    with pytest.raises(ValueError, match="between 1 and"):
        reduced_depth("qwen3.5-35b-a3b", 41)
    # by name, as a recipe's model.name: the first 8 layers (the pattern's second period)
    cut = get_preset("qwen3.5-35b-a3b-8L")
    assert cut.text["num_hidden_layers"] == 8
    assert cut.text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    with pytest.raises(ValueError, match="between 1 and"):
        get_preset("qwen3.5-35b-a3b-41L")


def test_unknown_preset_says_what_to_do():
    with pytest.raises(ValueError, match="preset"):
        build_model("tiny-nope", device="cpu")


# --- a preset on the user's data ---------------------------------------------------------------------
# A preset (random weights) on the user's data is refused unless `model.init=random` says so; the message
# names the published folder to download and how.
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


def test_the_config_knows_every_preset_by_name() -> None:
    """config.py names presets from vlpack.preset_names (below model/): the same names."""
    assert {n for n in PRESETS if not re.fullmatch(r".+-\d+L", n)} == set(NAMES)  # cuts aside
