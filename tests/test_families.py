"""The family registry (families.py): the classes it names exist, data and model agree."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                  "qwen3_5_moe"])
def test_family_registry_names_real_classes(name):
    """Every class the registry names exists in the installed transformers, and data and model
    agree on the family's sizes and token ids."""
    import importlib

    import transformers

    from vlpack.families import family

    f = family(name)
    assert getattr(transformers, f.hf_class)
    mod = importlib.import_module(f.modeling_module)
    for cls in (f.vision_attention, f.vision_tower, f.deepstack_text_model, f.gated_deltanet,
                f.model_class):
        assert cls is None or isinstance(getattr(mod, cls), type), cls
    spec = family(name)
    assert spec.image_pad_id == f.ids["image_token_id"] and spec.patch_size == f.patch_size
    assert spec.vision_start_id == f.ids["vision_start_token_id"]
    with pytest.raises(ValueError, match="not supported: vlpack runs qwen2_vl"):
        family("llava")
