"""Per-sample multimodal rotary (MRoPE) positions, computed without a model.

Qwen-VL text tokens take position p on all three axes (t, h, w); an image or video of merged
grid (t, h', w') placed at p takes p + t·step, p + row, p + col (step 1, or Qwen2.5-VL's
tokens_per_second × second_per_grid for a video). The text after it continues after the
largest position the item used (`after_video="qwen"`, Qwen's original rule) or at
p + max(h', w') (`"transformers"`, transformers >= 5.3); the two differ only after a video span
of several temporal patches (Qwen2/2.5-VL; Qwen3/3.5 write one span per patch). With
"transformers" this equals transformers' `get_rope_index` for images and videos in qwen2_vl,
qwen2_5_vl, qwen3_vl and qwen3_5 (tested against it), but runs on one sample at a time, so
positions restart at every sample boundary of a packed row. docs/data.md says which rule
training follows and why.

Legend: L = tokens of one sample, I = visual items (images, videos) of one sample.
"""

from __future__ import annotations

from typing import get_args

import numpy as np

from vlpack.config import AfterVideo
from vlpack.data.types import TOKEN_TYPE_TEXT, TOKEN_TYPE_VIDEO

AFTER_VIDEO = get_args(AfterVideo)
"""Where text after a visual span continues (`mrope_positions`; `data.mrope_after_video`)."""


def mrope_positions(
    mm_token_type_ids_L: np.ndarray,
    image_grid_thw_I3: np.ndarray,
    spatial_merge_size: int = 2,
    temporal_step_I: np.ndarray | None = None,
    *,
    after_video: str,
) -> np.ndarray:
    """3-row MRoPE positions [3, L] (int64) of one sample.

    Visual spans are the runs of non-text tokens. A span consumes the next grid whole, or,
    when it holds one temporal patch of a video grid of several (qwen3 families write a
    timestamp between temporal patches), that patch: the grid's next spans hold the others,
    as transformers splits a video grid into t grids of one patch. Temporal positions step by
    `temporal_step_I` of the item (1 when None; Qwen2.5-VL's tokens_per_second ×
    second_per_grid for a video), floored, in float32 as transformers computes them.
    `after_video` (`data.mrope_after_video`): where the text after a visual span continues,
    "qwen" (after its largest position) or "transformers" (its start + max(h', w')).
    """
    if after_video not in AFTER_VIDEO:
        raise ValueError(f"after_video={after_video!r}: use one of {', '.join(AFTER_VIDEO)}")
    types = np.asarray(mm_token_type_ids_L)
    L = types.shape[0]
    out = np.empty((3, L), dtype=np.int64)
    if L == 0:
        return out
    # Run-length encode the token types: [start, end) of each run.
    change = np.flatnonzero(np.diff(types)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [L]))
    pos = 0
    item, frames_left = 0, 0  # the grid being consumed and, for frame spans, its patches left
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        kind = int(types[s])
        if kind == TOKEN_TYPE_TEXT:
            out[:, s:e] = np.arange(pos, pos + e - s)
            pos += e - s
            continue
        if frames_left == 0:
            if item >= len(image_grid_thw_I3):
                raise ValueError(
                    f"sample has more visual spans than grids ({len(image_grid_thw_I3)}): "
                    "the image/video placeholders and the inputs do not match"
                )
            t, gh, gw = (int(x) for x in image_grid_thw_I3[item])
            step = 1.0 if temporal_step_I is None else float(temporal_step_I[item])
            item += 1
            if kind == TOKEN_TYPE_VIDEO and t > 1 and e - s == gh * gw // spatial_merge_size**2:
                frames_left, t = t, 1  # one span per temporal patch
        else:  # the next temporal patch of a video in frame spans
            t = 1
        frames_left = max(frames_left - 1, 0)
        h, w = gh // spatial_merge_size, gw // spatial_merge_size
        if t * h * w != e - s:
            raise ValueError(
                f"visual item {item - 1} spans {e - s} tokens but its grid {t}x{h}x{w} "
                f"(merged) needs {t * h * w}: two items are adjacent without a separator or "
                "the grid does not belong to this sample"
            )
        t_index = (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)
        tt, hh, ww = np.meshgrid(t_index, np.arange(h), np.arange(w), indexing="ij")
        out[0, s:e] = tt.reshape(-1) + pos
        out[1, s:e] = hh.reshape(-1) + pos
        out[2, s:e] = ww.reshape(-1) + pos
        pos += max(h, w) if after_video == "transformers" else max(int(t_index[-1]) + 1, h, w)
    if item != len(image_grid_thw_I3) or frames_left:
        raise ValueError(
            f"sample has {len(image_grid_thw_I3)} visual grids but {item} visual spans"
            + (f" ({frames_left} temporal patch(es) of the last video missing)"
               if frames_left else "")
        )
    return out
