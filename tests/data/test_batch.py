"""The THD batch: every field checked against a per-sample reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import PAD, make_sample
from vlpack.data.batch import build_thd_batch, shifted_labels
from vlpack.data.rope import mrope_positions
from vlpack.data.types import IGNORE_INDEX


def _samples(seed: int, n: int):
    rng = np.random.default_rng(seed)
    shapes = [
        dict(text=(5, 7), grids=((1, 4, 6),)),
        dict(text=(9,), grids=()),
        dict(text=(3, 2, 9), grids=((1, 6, 4), (1, 2, 2))),
        dict(text=(2, 1), grids=((1, 2, 4),)),
    ]
    return [make_sample(f"s{i}", rng, **shapes[(seed + i) % len(shapes)]) for i in range(n)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), n=st.integers(1, 5), mult=st.sampled_from([1, 4, 8, 64]),
       extra=st.integers(0, 50))
def test_batch_fields_match_per_sample_reference(seed: int, n: int, mult: int, extra: int) -> None:
    samples = _samples(seed, n)
    aligned = sum(-(-len(s) // mult) * mult for s in samples)
    b = build_thd_batch(samples, pad_token_id=PAD, pad_to_multiple_of=mult, total_len=aligned + extra,
            mrope_after_video="transformers")
    T = aligned + extra
    assert b.num_tokens == T
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens_padded.dtype == torch.int32
    assert b.cu_seqlens_padded[-1] == T
    seg = torch.diff(b.cu_seqlens_padded)
    assert (seg > 0).all(), "no zero-length segment"
    assert (b.cu_seqlens_padded[:-1] % mult == 0).all()
    assert b.max_seqlen == int(seg.max())
    assert b.seq_lengths == [len(s) for s in samples]
    assert b.sample_keys == [s.key for s in samples]
    real = torch.zeros(T, dtype=torch.bool)
    for i, s in enumerate(samples):
        sl = b.segment(i)
        real[sl] = True
        np.testing.assert_array_equal(b.input_ids[sl].numpy(), s.input_ids)
        np.testing.assert_array_equal(b.labels[sl].numpy(), shifted_labels(s.labels))
        assert b.labels[sl][-1] == IGNORE_INDEX, "a label never crosses into the next sample"
        np.testing.assert_array_equal(b.position_ids[0, sl].numpy(), np.arange(len(s)))
        np.testing.assert_array_equal(
            b.position_ids[1:, sl].numpy(),
            mrope_positions(s.mm_token_type_ids, s.image_grid_thw, after_video="transformers"),
        )
        np.testing.assert_array_equal(b.mm_token_type_ids[sl].numpy(), s.mm_token_type_ids)
    assert torch.equal(b.padding_mask, ~real)
    assert (b.labels[b.padding_mask] == IGNORE_INDEX).all()
    assert (b.input_ids[b.padding_mask] == PAD).all()
    assert b.num_label_tokens == int((b.labels != IGNORE_INDEX).sum())
    # Images in the order their tokens appear; pixels follow the grids.
    grids = [g for s in samples for g in s.image_grid_thw.tolist()]
    assert b.image_grid_thw.tolist() == grids
    if grids:
        pix = np.concatenate([s.pixel_values for s in samples if s.pixel_values is not None])
        np.testing.assert_array_equal(b.pixel_values.numpy(), pix)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        assert b.vision_cu_seqlens.tolist() == np.concatenate(([0], np.cumsum(frames))).tolist()
        assert b.vision_max_seqlen == max(frames)
    else:
        assert b.pixel_values is None and b.vision_cu_seqlens.tolist() == [0]


def test_row_zero_restarts_and_pads_continue() -> None:
    s = _samples(1, 2)
    b = build_thd_batch(s, pad_token_id=PAD, pad_to_multiple_of=8, mrope_after_video="transformers")
    starts = b.cu_seqlens_padded[:-1].tolist()
    assert all(b.position_ids[0, i] == 0 for i in starts)
    for i in range(2):
        a, z = b.cu_seqlens_padded[i], b.cu_seqlens_padded[i + 1]
        assert torch.equal(b.position_ids[0, a:z], torch.arange(z - a))


def test_tail_padding_joins_last_segment() -> None:
    s = _samples(0, 2)
    b = build_thd_batch(s, pad_token_id=PAD, total_len=100,
            pad_to_multiple_of=1, mrope_after_video="transformers")
    assert b.cu_seqlens_padded.tolist() == [0, len(s[0]), 100]


def test_too_small_total_len_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="total_len"):
        build_thd_batch(_samples(0, 2), pad_token_id=PAD, total_len=5,
                pad_to_multiple_of=1, mrope_after_video="transformers")


def test_empty_bin_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="zero samples"):
        build_thd_batch([], pad_token_id=PAD, pad_to_multiple_of=1, mrope_after_video="transformers")


def test_pin_and_to_keep_host_fields() -> None:
    b = build_thd_batch(_samples(2, 3), pad_token_id=PAD,
            pad_to_multiple_of=1, mrope_after_video="transformers")
    c = b.to("cpu")
    assert c.sample_keys == b.sample_keys and c.max_seqlen == b.max_seqlen
    assert torch.equal(c.input_ids, b.input_ids)
