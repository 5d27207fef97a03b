"""Per-sample MRoPE equals transformers' get_rope_index on the sample alone."""

import inspect
import types

import numpy as np
import pytest
import torch

from tests.helpers import IMAGE_PAD, VISION_END, VISION_START, make_sample
from vlpack.data.rope import mrope_positions

FAMILIES = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel"),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Model"),
}


def hf_rope_index(family: str, input_ids, types_, grids) -> np.ndarray:
    """Call the family's get_rope_index on a stand-in `self` (no weights needed)."""
    import importlib

    mod_name, cls_name = FAMILIES[family]
    cls = getattr(importlib.import_module(mod_name), cls_name)
    vision = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=2, temporal_patch_size=2)
    config = types.SimpleNamespace(
        vision_config=vision,
        image_token_id=IMAGE_PAD,
        video_token_id=IMAGE_PAD + 1,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    fake = types.SimpleNamespace(config=config, spatial_merge_size=2)
    if hasattr(cls, "get_vision_position_ids"):
        fake.get_vision_position_ids = types.MethodType(cls.get_vision_position_ids, fake)
    kwargs = {
        "input_ids": torch.as_tensor(input_ids)[None],
        "image_grid_thw": torch.as_tensor(grids) if len(grids) else None,
    }
    if "mm_token_type_ids" in inspect.signature(cls.get_rope_index).parameters:  # transformers >= 5.2x
        kwargs["mm_token_type_ids"] = torch.as_tensor(types_, dtype=torch.int32)[None]
    pos, _ = cls.get_rope_index(fake, **kwargs)
    return pos[:, 0].numpy()


CASES = {
    "one_image": dict(text=(5, 7), grids=((1, 4, 6),)),
    "two_images": dict(text=(3, 2, 9), grids=((1, 6, 4), (1, 2, 2))),
    "tall_image": dict(text=(1, 4), grids=((1, 12, 4),)),
    "image_first_and_last": dict(text=(0, 3, 0), grids=((1, 4, 4), (1, 8, 2))),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", list(CASES))
def test_mrope_matches_transformers(family: str, case: str) -> None:
    s = make_sample("s", np.random.default_rng(0), **CASES[case])
    ours = mrope_positions(s.mm_token_type_ids, s.image_grid_thw, 2)
    theirs = hf_rope_index(family, s.input_ids, s.mm_token_type_ids, s.image_grid_thw)
    np.testing.assert_array_equal(ours, theirs)


def test_text_only_positions_are_arange() -> None:
    pos = mrope_positions(np.zeros(6, dtype=np.int8), np.zeros((0, 3), dtype=np.int64))
    np.testing.assert_array_equal(pos, np.tile(np.arange(6), (3, 1)))


def test_grid_mismatch_is_a_clear_error() -> None:
    s = make_sample("s", np.random.default_rng(0))
    with pytest.raises(ValueError, match="visual item 0 spans"):
        mrope_positions(s.mm_token_type_ids, np.array([[1, 2, 2]]), 2)
    with pytest.raises(ValueError, match="more visual spans than grids"):
        mrope_positions(s.mm_token_type_ids, np.zeros((0, 3), dtype=np.int64), 2)


def test_whole_row_rope_index_continues_across_samples() -> None:
    """The pitfall we avoid: transformers' get_rope_index over a packed row does not restart."""
    rng = np.random.default_rng(1)
    a, b = make_sample("a", rng), make_sample("b", rng)
    ids = np.concatenate([a.input_ids, b.input_ids])
    t = np.concatenate([a.mm_token_type_ids, b.mm_token_type_ids])
    g = np.concatenate([a.image_grid_thw, b.image_grid_thw])
    whole = hf_rope_index("qwen3_vl", ids, t, g)
    per_sample = np.concatenate(
        [mrope_positions(s.mm_token_type_ids, s.image_grid_thw) for s in (a, b)], axis=1
    )
    assert not np.array_equal(whole, per_sample)
    np.testing.assert_array_equal(whole[:, : len(a)], per_sample[:, : len(a)])
