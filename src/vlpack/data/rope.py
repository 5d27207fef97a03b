"""Per-sample multimodal rotary (MRoPE) positions, computed without a model.

Qwen-VL text tokens take position p on all three axes (t, h, w); an image of merged grid
(t, h', w') placed at p takes t + p, p + row, p + col; the text after it continues at
p + max(h', w'). This equals transformers' `get_rope_index` for images in qwen2_vl,
qwen2_5_vl, qwen3_vl and qwen3_5 (tested against it), but runs on one sample at a time, so
positions restart at every sample boundary of a packed row.

Legend: L = tokens of one sample, I = images of one sample.
"""

from __future__ import annotations

import numpy as np

from vlpack.data.types import TOKEN_TYPE_TEXT


def mrope_positions(
    mm_token_type_ids_L: np.ndarray, image_grid_thw_I3: np.ndarray, spatial_merge_size: int = 2
) -> np.ndarray:
    """3-row MRoPE positions [3, L] (int64) of one sample.

    Image spans are the runs of non-text tokens; the k-th run consumes the k-th grid.
    """
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
    image = 0
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if types[s] == TOKEN_TYPE_TEXT:
            out[:, s:e] = np.arange(pos, pos + e - s)
            pos += e - s
            continue
        if image >= len(image_grid_thw_I3):
            raise ValueError(
                f"sample has more image spans than image grids ({len(image_grid_thw_I3)}): "
                "the image placeholders and the images do not match"
            )
        t, h, w = (int(x) for x in image_grid_thw_I3[image])
        image += 1
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != e - s:
            raise ValueError(
                f"image {image - 1} spans {e - s} tokens but its grid {t}x{h}x{w} (merged) "
                f"needs {t * h * w}: two images are adjacent without a separator or the grid "
                "does not belong to this sample"
            )
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[0, s:e] = tt.reshape(-1) + pos
        out[1, s:e] = hh.reshape(-1) + pos
        out[2, s:e] = ww.reshape(-1) + pos
        pos += max(h, w)
    if image != len(image_grid_thw_I3):
        raise ValueError(
            f"sample has {len(image_grid_thw_I3)} image grids but {image} image spans"
        )
    return out
