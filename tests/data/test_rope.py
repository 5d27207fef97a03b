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
    ours = mrope_positions(s.mm_token_type_ids, s.image_grid_thw, 2,
                           after_video="transformers")
    theirs = hf_rope_index(family, s.input_ids, s.mm_token_type_ids, s.image_grid_thw)
    np.testing.assert_array_equal(ours, theirs)


def test_text_only_positions_are_arange() -> None:
    pos = mrope_positions(np.zeros(6, dtype=np.int8), np.zeros((0, 3), dtype=np.int64),
                          after_video="qwen")
    np.testing.assert_array_equal(pos, np.tile(np.arange(6), (3, 1)))


def test_grid_mismatch_is_a_clear_error() -> None:
    s = make_sample("s", np.random.default_rng(0))
    with pytest.raises(ValueError, match="visual item 0 spans"):
        mrope_positions(s.mm_token_type_ids, np.array([[1, 2, 2]]), 2, after_video="qwen")
    with pytest.raises(ValueError, match="more visual spans than grids"):
        mrope_positions(s.mm_token_type_ids, np.zeros((0, 3), dtype=np.int64), 2,
                        after_video="qwen")


def test_whole_row_rope_index_continues_across_samples() -> None:
    """The pitfall we avoid: transformers' get_rope_index over a packed row does not restart."""
    rng = np.random.default_rng(1)
    a, b = make_sample("a", rng), make_sample("b", rng)
    ids = np.concatenate([a.input_ids, b.input_ids])
    t = np.concatenate([a.mm_token_type_ids, b.mm_token_type_ids])
    g = np.concatenate([a.image_grid_thw, b.image_grid_thw])
    whole = hf_rope_index("qwen3_vl", ids, t, g)
    per_sample = np.concatenate(
        [mrope_positions(s.mm_token_type_ids, s.image_grid_thw, after_video="transformers")
         for s in (a, b)], axis=1
    )
    assert not np.array_equal(whole, per_sample)
    np.testing.assert_array_equal(whole[:, : len(a)], per_sample[:, : len(a)])


# --- text after a video of several temporal patches (Qwen2/2.5-VL) -------------------------------
VIDEO_PAD = IMAGE_PAD + 1


def _text_video_text(n_before: int, grid: tuple[int, int, int], n_after: int):
    """Input ids and token types of text, one video (a span of all its temporal patches), text."""
    t, h, w = grid
    k = t * h * w // 4
    ids = [5] * n_before + [VISION_START] + [VIDEO_PAD] * k + [VISION_END] + [7] * n_after
    types = [0] * (n_before + 1) + [2] * k + [0] * (1 + n_after)
    return np.array(ids), np.array(types, dtype=np.int8)


def hf_video_rope_index(family: str, ids, types_, grid, second_per_grid: float | None = None):
    """The family's get_rope_index on one sample holding one video (as `hf_rope_index`)."""
    import importlib

    mod_name, cls_name = FAMILIES[family]
    cls = getattr(importlib.import_module(mod_name), cls_name)
    vision = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=2, temporal_patch_size=2)
    config = types.SimpleNamespace(vision_config=vision, image_token_id=IMAGE_PAD,
                                   video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                                   vision_end_token_id=VISION_END)
    fake = types.SimpleNamespace(config=config, spatial_merge_size=2)
    if hasattr(cls, "get_vision_position_ids"):
        fake.get_vision_position_ids = types.MethodType(cls.get_vision_position_ids, fake)
    kwargs = {"input_ids": torch.as_tensor(ids)[None], "video_grid_thw": torch.tensor([grid])}
    params = inspect.signature(cls.get_rope_index).parameters
    if "mm_token_type_ids" in params:
        kwargs["mm_token_type_ids"] = torch.as_tensor(types_, dtype=torch.int32)[None]
    if second_per_grid is not None:
        kwargs["second_per_grid_ts"] = torch.tensor([second_per_grid])
    pos, _ = cls.get_rope_index(fake, **kwargs)
    return pos[:, 0].numpy()


def test_text_after_a_video_literal() -> None:
    """A (3, 4, 4) video after the text (merged 3x2x2, starting at position 3): its positions
    reach 5 on the temporal axis. Qwen's rule continues after that, transformers' (>= 5.3) at
    3 + max(2, 2)."""
    _, types_ = _text_video_text(2, (3, 4, 4), 2)
    grids = np.array([[3, 4, 4]])
    qwen = mrope_positions(types_, grids, 2, after_video="qwen")
    hf = mrope_positions(types_, grids, 2, after_video="transformers")
    np.testing.assert_array_equal(qwen[:, 3:15], hf[:, 3:15])  # the video itself
    assert qwen[0, 3:15].max() == 5 and qwen[1, 3:15].max() == 4
    np.testing.assert_array_equal(qwen[:, 15:], np.tile([6, 7, 8], (3, 1)))
    np.testing.assert_array_equal(hf[:, 15:], np.tile([5, 6, 7], (3, 1)))
    with pytest.raises(ValueError, match="after_video='megatron'"):
        mrope_positions(types_, grids, 2, after_video="megatron")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_installed_transformers_rule_after_a_video(family: str) -> None:
    """vlpack's "transformers" rule equals the installed get_rope_index after a video of three
    temporal patches, and that rule is still start + max(h', w'), not Qwen's original: a change
    in transformers fails here (then data.mrope_after_video and docs/data.md need a look)."""
    ids, types_ = _text_video_text(2, (3, 4, 4), 2)
    step = 0.5 if family == "qwen2_5_vl" else None  # 2 tokens/s x 0.5 s: temporal step 1
    theirs = hf_video_rope_index(family, ids, types_, (3, 4, 4), step)
    ours = mrope_positions(types_, np.array([[3, 4, 4]]), 2, after_video="transformers")
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(theirs[:, 15:], np.tile([5, 6, 7], (3, 1)))  # pinned
    qwen = mrope_positions(types_, np.array([[3, 4, 4]]), 2, after_video="qwen")
    assert not np.array_equal(qwen, theirs)  # the known difference


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rules_agree_on_images(family: str) -> None:
    """Where transformers and Qwen's rule agree (images: one temporal patch), both equal the
    installed get_rope_index."""
    s = make_sample("s", np.random.default_rng(2), **CASES["two_images"])
    theirs = hf_rope_index(family, s.input_ids, s.mm_token_type_ids, s.image_grid_thw)
    for rule in ("qwen", "transformers"):
        np.testing.assert_array_equal(
            mrope_positions(s.mm_token_type_ids, s.image_grid_thw, 2, after_video=rule), theirs)


def test_training_default_is_qwens_rule() -> None:
    from vlpack.config import load_config

    assert load_config("tiny").data.mrope_after_video == "qwen"
    with pytest.raises(ValueError, match=r"data\.mrope_after_video"):
        load_config("tiny", ["data.mrope_after_video=megatron"])


def test_batch_builds_the_rule_it_is_given() -> None:
    """The THD row's positions follow `mrope_after_video` (the loaders pass the data config's)."""
    from vlpack.data.batch import build_thd_batch
    from vlpack.data.types import TOKEN_TYPE_VIDEO

    s = make_sample("v", np.random.default_rng(3), text=(2, 3), grids=((3, 4, 4),))
    s.mm_token_type_ids[s.mm_token_type_ids != 0] = TOKEN_TYPE_VIDEO
    for rule in ("qwen", "transformers"):
        batch = build_thd_batch([s, s], pad_token_id=0, mrope_after_video=rule, pad_to_multiple_of=1)
        want = mrope_positions(s.mm_token_type_ids, s.image_grid_thw, 2, after_video=rule)
        np.testing.assert_array_equal(batch.position_ids[1:, len(s):].numpy(), want)
    assert want[0, -1] != mrope_positions(s.mm_token_type_ids, s.image_grid_thw, 2,
                                          after_video="qwen")[0, -1]
