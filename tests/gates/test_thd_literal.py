"""A bin of three samples worked out by hand: every THD field as a literal.

Nothing here is computed by vlpack's code: the expected ids, shifted labels, positions and both
boundary tensors were written down from the contract in data/batch.py (labels shifted per sample,
positions restarting per sample, MRoPE of the image as Qwen's get_rope_index gives it, pads
continuing the count, tail padding joining the last segment).
"""

from __future__ import annotations

import numpy as np
import torch

from vlpack.data.batch import build_thd_batch
from vlpack.data.types import IGNORE_INDEX as X
from vlpack.data.types import EncodedSample

PAD, VS, IMG, VE = 99, 90, 91, 92


def _sample(key, ids, labels, types, grids=(), pixels=None) -> EncodedSample:
    return EncodedSample(key=key, input_ids=np.array(ids, dtype=np.int64),
                         labels=np.array(labels, dtype=np.int64),
                         mm_token_type_ids=np.array(types, dtype=np.int8),
                         image_grid_thw=np.array(grids, dtype=np.int64).reshape(-1, 3),
                         pixel_values=pixels)


def test_three_samples_with_an_image_by_hand() -> None:
    pixels = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)  # grid 1x2x4 = 8 patches
    a = _sample("a", [1, 2, 3, 4, 5], [X, X, 3, 4, 5], [0] * 5)
    b = _sample("b", [6, VS, IMG, IMG, VE, 7, 8], [X, X, X, X, X, 7, 8],
                [0, 0, 1, 1, 0, 0, 0], grids=[(1, 2, 4)], pixels=pixels)
    c = _sample("c", [9, 10, 11], [X, 10, 11], [0, 0, 0])
    batch = build_thd_batch([a, b, c], pad_token_id=PAD, pad_to_multiple_of=4, total_len=24,
                            spatial_merge_size=2, mrope_after_video="transformers")

    P = PAD
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, P, P, P,
                                        6, VS, IMG, IMG, VE, 7, 8, P,
                                        9, 10, 11, P, P, P, P, P]
    # labels[t] is the target of position t within the same sample; a sample's last token and
    # every pad have none
    assert batch.labels.tolist() == [X, 3, 4, 5, X, X, X, X,
                                     X, X, X, X, 7, 8, X, X,
                                     10, 11, X, X, X, X, X, X]
    assert batch.position_ids.tolist() == [
        # row 0: text position, restarting per padded segment
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7],
        # rows 1-3: MRoPE (t, h, w). The image (merged grid 1x1x2) starts at 2; the text after
        # it at 2 + max(h, w) = 4; pads continue from the sample's last position.
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 2, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 2, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7],
    ]
    assert batch.cu_seqlens.tolist() == [0, 5, 12, 15]
    assert batch.cu_seqlens_padded.tolist() == [0, 8, 16, 24]
    assert batch.padded_bounds == (0, 8, 16, 24)
    assert batch.max_seqlen == 8
    assert batch.mm_token_type_ids.tolist() == [0] * 10 + [1, 1] + [0] * 12
    assert batch.padding_mask.tolist() == ([False] * 5 + [True] * 3 + [False] * 7 + [True]
                                           + [False] * 3 + [True] * 5)
    assert batch.vision_cu_seqlens.tolist() == [0, 8]
    assert batch.vision_max_seqlen == 8
    assert batch.image_grid_thw.tolist() == [[1, 2, 4]]
    assert batch.image_grids == ((1, 2, 4),)
    assert torch.equal(batch.pixel_values, torch.from_numpy(pixels))
    assert batch.sample_keys == ["a", "b", "c"]
    assert batch.num_label_tokens == 7
    assert [batch.segment(i) for i in range(3)] == [slice(0, 5), slice(8, 15), slice(16, 19)]
