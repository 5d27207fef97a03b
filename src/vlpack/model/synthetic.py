"""Synthetic EncodedSamples with real token ids, for tests and `vlpack check`.

Each sample is chat-shaped text with 0-2 images and videos: <|vision_start|> + image pads
(t·h·w / merge² of them) + <|vision_end|>, a video the same with video pads (qwen3 families:
inside an outer start/end, one such span per temporal patch after a stand-in for its timestamp
text, as their processor expands it), random pixel
patches of the model's patch width, and labels on the "assistant" tail. Independent of the data
encoder so the model side can be proven on its own. Text ids come from `text_id_range`: inside
the model's vocabulary and away from its special ids, whatever its size (the released 151,936 or
248,320, or the 99 of transformers' own test configs).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import numpy as np

from vlpack.data.types import (
    IGNORE_INDEX,
    TOKEN_TYPE_IMAGE,
    TOKEN_TYPE_TEXT,
    TOKEN_TYPE_VIDEO,
    EncodedSample,
)
from vlpack.families import family
from vlpack.model.build import ModelSpec

TEXT_DRAW_WIDTH = 150_000
"""Widest range plain text ids are drawn from: inside the BPE ranks of every released vocabulary."""


def special_ids(spec: ModelSpec) -> set[int]:
    """The ids the model treats apart: image, video, vision start/end, pad and eos."""
    return {spec.image_token_id, spec.video_token_id, spec.vision_start_token_id,
            spec.vision_end_token_id, spec.pad_token_id, spec.eos_token_id}


def text_id_range(spec: ModelSpec) -> tuple[int, int]:
    """[lo, hi): the widest run of ids inside the vocabulary that holds none of the model's
    special ids. [0, 151643) for the released Qwen2/2.5/3-VL vocabulary, [7, 99) for
    transformers' test configs (vocab 99, special ids 0-6)."""
    edges = [-1, *sorted(i for i in special_ids(spec) if 0 <= i < spec.vocab_size),
             spec.vocab_size]
    lo, hi = max(((a + 1, b) for a, b in pairwise(edges)), key=lambda r: r[1] - r[0])
    if hi - lo < 2:
        raise ValueError(f"{spec.name}: vocabulary of {spec.vocab_size} ids leaves no range of "
                         "plain text ids between its special ids")
    return lo, hi


def _text_ids(spec: ModelSpec, rng: np.random.Generator, n: int) -> list[int]:
    lo, hi = text_id_range(spec)
    return rng.integers(lo, min(hi, lo + TEXT_DRAW_WIDTH), size=n).tolist()


def fit_ids(sample: EncodedSample, spec: ModelSpec, vision_ids: dict[str, int]) -> EncodedSample:
    """`sample`, encoded by a tokenizer whose ids are not the model's, with ids the model can
    read: the tokenizer's `vision_ids` (image_token_id, video_token_id, vision_start_token_id,
    vision_end_token_id) become the model's, every other id is folded into `text_id_range`.
    Unchanged when every id already fits (the same ids and all inside the vocabulary)."""
    ids = sample.input_ids
    same = all(getattr(spec, k) == v for k, v in vision_ids.items())
    if same and (len(ids) == 0 or int(ids.max()) < spec.vocab_size):
        return sample
    lo, hi = text_id_range(spec)
    out = lo + ids % (hi - lo)
    for k, v in vision_ids.items():
        out[ids == v] = getattr(spec, k)
    labels = np.where(sample.labels != IGNORE_INDEX, out, IGNORE_INDEX)
    return replace(sample, input_ids=out, labels=labels)


def synthetic_sample(
    spec: ModelSpec,
    rng: np.random.Generator,
    key: str,
    *,
    text_len: int = 24,
    grids: list[tuple[int, int, int]] = (),
    videos: tuple[int, ...] = (),
    second_per_grid: float = 1.0,
) -> EncodedSample:
    """One sample: text of `text_len` tokens around the visual items of the given (t, h, w)
    grids; the items at indices `videos` are videos spanning `second_per_grid` seconds per
    temporal patch."""
    fam = family(spec.family)
    m2 = spec.merge_size**2
    ids, types = [], []
    pieces = max(len(grids) + 1, 1)
    cut = np.sort(rng.choice(np.arange(1, text_len), size=pieces - 1, replace=False)) \
        if pieces > 1 else np.array([], dtype=int)
    spans = np.diff(np.concatenate(([0], cut, [text_len])))
    for i, n in enumerate(spans):
        ids += _text_ids(spec, rng, int(n))
        types += [TOKEN_TYPE_TEXT] * int(n)
        if i < len(grids):
            t, h, w = grids[i]
            video = i in videos
            timed = video and fam.video_style == "qwen3"
            spans = [h * w // m2] * t if timed else [t * h * w // m2]
            if timed:  # the outer pair transformers keeps around a qwen3-family video
                ids.append(spec.vision_start_token_id)
                types.append(TOKEN_TYPE_TEXT)
            for n_pad in spans:
                if timed:  # the timestamp text before each temporal patch
                    ids += _text_ids(spec, rng, 3)
                    types += [TOKEN_TYPE_TEXT] * 3
                pad, kind = ((spec.video_token_id, TOKEN_TYPE_VIDEO) if video else
                             (spec.image_token_id, TOKEN_TYPE_IMAGE))
                ids += [spec.vision_start_token_id] + [pad] * n_pad + [spec.vision_end_token_id]
                types += [TOKEN_TYPE_TEXT] + [kind] * n_pad + [TOKEN_TYPE_TEXT]
            if timed:
                ids.append(spec.vision_end_token_id)
                types.append(TOKEN_TYPE_TEXT)
    ids += [spec.eos_token_id]
    types += [TOKEN_TYPE_TEXT]
    input_ids = np.asarray(ids, dtype=np.int64)
    labels = np.full_like(input_ids, IGNORE_INDEX)
    tail = max(2, len(ids) // 3)
    labels[-tail:] = input_ids[-tail:]
    labels[np.asarray(types) != TOKEN_TYPE_TEXT] = IGNORE_INDEX
    grid_arr = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    patches = int(grid_arr.prod(axis=1).sum()) if len(grid_arr) else 0
    pixels = rng.standard_normal((patches, spec.patch_dim)).astype(np.float32) if patches else None
    return EncodedSample(
        key=key,
        input_ids=input_ids,
        labels=labels,
        mm_token_type_ids=np.asarray(types, dtype=np.int8),
        image_grid_thw=grid_arr,
        pixel_values=pixels,
        visual_kinds=np.array([TOKEN_TYPE_VIDEO if i in videos else TOKEN_TYPE_IMAGE
                               for i in range(len(grids))], dtype=np.int8),
        second_per_grid=np.array([second_per_grid if i in videos else 0.0
                                  for i in range(len(grids))], dtype=np.float32),
        temporal_step=np.array([spec.tokens_per_second * second_per_grid
                                if i in videos and spec.tokens_per_second else 1.0
                                for i in range(len(grids))], dtype=np.float32),
    )


def default_mix(spec: ModelSpec, n: int, seed: int = 0) -> list[EncodedSample]:
    """n samples cycling through: two images (one a 2×128-patch strip), text only, an image and
    a video of 3 temporal patches, one larger image.

    Grids are (1..3)×(4..16)×(4..16) patches (window attention needs 16×16 on qwen2.5: one such
    image is in every cycle of four). The strip's h and w positions differ by up to 63: with
    the published rope thetas (1e6-1e7) an image-position error (h and w swapped) then moves
    the logits 17-29x past `vlpack check`'s fp32 tolerance on the tiny Qwen2/2.5-VL shapes,
    whose h and w get the slowest rotary frequencies; small square grids alone gave 2-3x."""
    rng = np.random.default_rng(seed)
    kinds = [
        [(1, 4, 6), (1, 2, 128)],  # multi-image, one a wide strip
        [],                      # text only
        [(1, 8, 8), (3, 4, 8)],  # image + video
        [(1, 16, 16)] if spec.family == "qwen2_5_vl" else [(1, 8, 12)],
    ]
    out = []
    for i in range(n):
        grids = kinds[i % len(kinds)]
        out.append(synthetic_sample(spec, rng, f"synthetic-{seed}-{i}",
                                    text_len=int(rng.integers(12, 40)), grids=grids,
                                    videos=(1,) if i % len(kinds) == 2 else ()))
    return out
