"""The THD packed batch and the one function that builds its metadata.

A bin of S samples becomes one row of T tokens. Sample i occupies the padded segment
[cu_seqlens_padded[i], cu_seqlens_padded[i+1]); its real tokens are the first
cu_seqlens[i+1] - cu_seqlens[i] of that segment, the rest is padding (this is Transformer
Engine's `cu_seqlens` / `cu_seqlens_padded` convention). Padding exists only to align segment
starts to `pad_to_multiple_of` (context/tensor parallel, FP8) and to fill the row to a fixed
length; the row's tail padding joins the last segment, so no segment is ever empty.

Legend: T = tokens in the row, S = samples, I = images, P = ViT patches, C = flattened patch
dim (channels × temporal patch × patch²), F = image frames (t of each grid, summed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from vlpack.config import DataConfig
from vlpack.data.rope import mrope_positions
from vlpack.data.types import FILLER_KEY, IGNORE_INDEX, TOKEN_TYPE_TEXT, EncodedSample


@dataclass
class ThdBatch:
    """One packed row (THD layout, no batch dimension).

    Tensor fields:
      input_ids          [T] int64 — pad positions hold `pad_token_id`.
      labels             [T] int64 — already shifted per sample: labels[t] is the target of
                         position t (the next token of the same sample); the last token of every
                         sample and every pad are IGNORE_INDEX (-100). Never shift again.
      position_ids       [4, T] int64 — row 0: text position restarting at 0 per sample (pads
                         continue counting); rows 1-3: that sample's MRoPE (t, h, w), computed
                         on the sample alone.
      cu_seqlens         [S+1] int32 — cumulative REAL lengths (no padding).
      cu_seqlens_padded  [S+1] int32 — cumulative padded lengths: segment boundaries in the
                         row, each a multiple of pad_to_multiple_of except the last (== T).
                         Kernels use these; boundaries are never inferred from positions.
      mm_token_type_ids  [T] int32 — 0 text, 1 image, 2 video.
      padding_mask       [T] bool — True on padding (and on the loader's filler token).
      pixel_values       [P, C] float32 — patches of all visual items (images and videos), in
                         the order their tokens appear in the row; None when the row has none.
      image_grid_thw     [I, 3] int64 — (t, h, w) in patches of each item, same order (the
                         vision tower encodes images and videos alike, in one call).
      vision_cu_seqlens  [F+1] int32 — per-frame patch boundaries for the vision tower's
                         bidirectional varlen attention (one frame = h·w patches).
    Host-side fields (Python ints/lists, no device sync needed):
      max_seqlen         longest padded segment; vision_max_seqlen: longest frame in patches.
      image_grids        image_grid_thw's rows as (t, h, w) tuples.
      padded_bounds      cu_seqlens_padded as a tuple.
      image_positions    row positions of the visual tokens (mm_token_type_ids != 0), ascending.
      sample_keys        S stable sample keys; num_label_tokens: labels != -100.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    mm_token_type_ids: torch.Tensor
    padding_mask: torch.Tensor
    image_grid_thw: torch.Tensor
    vision_cu_seqlens: torch.Tensor
    pixel_values: torch.Tensor | None = None
    max_seqlen: int = 0
    vision_max_seqlen: int = 0
    image_grids: tuple[tuple[int, int, int], ...] = ()
    padded_bounds: tuple[int, ...] = ()
    image_positions: tuple[int, ...] = ()
    sample_keys: list[str] = field(default_factory=list)
    num_label_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """T, the row length including padding."""
        return int(self.input_ids.shape[0])

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_samples(self) -> int:
        return len(self.sample_keys)

    @property
    def seq_lengths(self) -> list[int]:
        """Real length of each sample."""
        return torch.diff(self.cu_seqlens).tolist()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ThdBatch:
        """Move every tensor to `device` (host fields stay on the host)."""
        return map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> ThdBatch:
        """Called by DataLoader(pin_memory=True)."""
        return map_tensors(self, lambda t: t.pin_memory())

    def segment(self, i: int) -> slice:
        """Slice of the row holding sample i's real tokens."""
        start = int(self.cu_seqlens_padded[i])
        return slice(start, start + int(self.cu_seqlens[i + 1] - self.cu_seqlens[i]))


def map_tensors(batch, fn):
    """A copy of a batch dataclass with `fn` applied to every tensor field."""
    return replace(batch, **{f.name: fn(v) for f in fields(batch)
                             if isinstance(v := getattr(batch, f.name), torch.Tensor)})


def shifted_labels(labels_L: np.ndarray) -> np.ndarray:
    """Labels of one sample shifted left by one: position t predicts token t+1; the last
    position gets IGNORE_INDEX, so no label ever crosses into the next sample."""
    out = np.full_like(labels_L, IGNORE_INDEX)
    out[:-1] = labels_L[1:]
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def build_thd_batch(
    samples: Sequence[EncodedSample],
    *,
    pad_token_id: int,
    pad_to_multiple_of: int,
    total_len: int | None = None,
    spatial_merge_size: int = 2,
    mrope_after_video: str,
) -> ThdBatch:
    """Pack `samples` into one THD row; the only place THD metadata is made.

    Each sample is padded to a multiple of `pad_to_multiple_of`; with `total_len` the row is
    padded further to exactly that length (static shapes), the extra joining the last segment.
    `mrope_after_video`: where text after a video of several temporal patches continues
    (`vlpack.data.rope.mrope_positions`): `data.mrope_after_video` in training; "transformers"
    (the installed model code's rule) where a stock model is the reference.
    """
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    real = [len(s) for s in samples]
    if min(real) == 0:
        raise ValueError(f"sample {samples[real.index(0)].key!r} has no tokens")
    padded = [_round_up(n, pad_to_multiple_of) for n in real]
    T = sum(padded)
    if total_len is not None:
        if total_len < T:
            raise ValueError(
                f"bin needs {T} tokens after alignment padding but total_len is {total_len}: "
                "plan bins against the aligned lengths or raise the sequence length"
            )
        padded[-1] += total_len - T
        T = total_len

    input_ids = np.full(T, pad_token_id, dtype=np.int64)
    labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty((4, T), dtype=np.int64)
    types = np.zeros(T, dtype=np.int32)
    padding_mask = np.ones(T, dtype=bool)
    start = 0
    for s, n, p in zip(samples, real, padded, strict=True):
        seg = slice(start, start + n)
        input_ids[seg] = s.input_ids
        labels[seg] = shifted_labels(s.labels)
        types[seg] = s.mm_token_type_ids
        padding_mask[seg] = s.key == FILLER_KEY  # the loader's filler is no real token
        mrope = mrope_positions(s.mm_token_type_ids, s.image_grid_thw, spatial_merge_size,
                                s.temporal_step, after_video=mrope_after_video)
        position_ids[0, start : start + p] = np.arange(p)
        position_ids[1:, seg] = mrope
        # Pads continue counting after the sample's last position: they only attend backwards
        # within their own segment, so their values never reach a real token.
        last = mrope[:, -1:] if n else np.zeros((3, 1), dtype=np.int64)
        position_ids[1:, start + n : start + p] = last + np.arange(1, p - n + 1)
        start += p

    grids = [s.image_grid_thw for s in samples if len(s.image_grid_thw)]
    grid_thw = (
        np.concatenate(grids).astype(np.int64) if grids else np.zeros((0, 3), dtype=np.int64)
    )
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None and len(s.pixel_values)]
    pixel_values = torch.from_numpy(np.concatenate(pixels)) if pixels else None
    if pixel_values is not None and pixel_values.shape[0] != int(grid_thw.prod(axis=1).sum()):
        raise ValueError(
            f"pixel rows ({pixel_values.shape[0]}) do not match the image grids "
            f"({int(grid_thw.prod(axis=1).sum())} patches): encode samples with pixels"
        )
    frames = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    bounds = tuple(int(b) for b in np.concatenate(([0], np.cumsum(padded))))
    return ThdBatch(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.tensor(np.concatenate(([0], np.cumsum(real))), dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(bounds, dtype=torch.int32),
        mm_token_type_ids=torch.from_numpy(types),
        padding_mask=torch.from_numpy(padding_mask),
        image_grid_thw=torch.from_numpy(grid_thw),
        vision_cu_seqlens=torch.tensor(np.concatenate(([0], np.cumsum(frames))), dtype=torch.int32),
        pixel_values=pixel_values,
        max_seqlen=max(padded),
        vision_max_seqlen=int(frames.max()) if len(frames) else 0,
        image_grids=tuple(tuple(int(x) for x in row) for row in grid_thw),
        padded_bounds=bounds,
        image_positions=tuple(np.flatnonzero(types != TOKEN_TYPE_TEXT).tolist()),
        sample_keys=[s.key for s in samples],
        num_label_tokens=int((labels != IGNORE_INDEX).sum()),
    )


def packed_row(samples: Sequence[EncodedSample], d: DataConfig, *, pad_token_id: int,
               spatial_merge_size: int) -> ThdBatch:
    """The THD row the trainer trains on for `samples` (one planned bin), under the data
    section `d`: each segment aligned to `data.pad_to_multiple_of`, the row padded to
    `data.seq_len` with `data.pad_to_seq_len`, MRoPE by `data.mrope_after_video`."""
    return build_thd_batch(
        samples, pad_token_id=pad_token_id, pad_to_multiple_of=d.pad_to_multiple_of,
        total_len=d.seq_len if d.pad_to_seq_len else None,
        spatial_merge_size=spatial_merge_size, mrope_after_video=d.mrope_after_video,
    )
