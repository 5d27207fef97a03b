"""Right-padded batches: the usual transformers way, kept as the baseline packing is measured
against (`data.packing=none`).

Legend: B = samples in the batch, L = longest sample, P = ViT patches, C = flattened patch dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vlpack.data.batch import map_tensors, shifted_labels
from vlpack.data.types import IGNORE_INDEX, EncodedSample


@dataclass
class PaddedBatch:
    """B samples right-padded to the longest.

    input_ids [B, L] int64; labels [B, L] int64 (shifted per sample like ThdBatch.labels, pads
    IGNORE_INDEX); attention_mask [B, L] int64 (1 real, 0 pad); mm_token_type_ids [B, L] int32;
    pixel_values [P, C] float32 or None; image_grid_thw [I, 3] int64 — the images (sample
    order); pixel_values_videos, video_grid_thw [V, 3] and second_per_grid_ts [V] — the videos
    (None when the batch has none): transformers' own inputs.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    image_grid_thw: torch.Tensor
    pixel_values: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    sample_keys: list[str] = field(default_factory=list)
    num_label_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_samples(self) -> int:
        return len(self.sample_keys)

    @property
    def seq_lengths(self) -> list[int]:
        """Real length of each sample (as ThdBatch.seq_lengths)."""
        return self.attention_mask.sum(1).tolist()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PaddedBatch:
        return map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PaddedBatch:
        return map_tensors(self, lambda t: t.pin_memory())


def build_padded_batch(samples: Sequence[EncodedSample], *, pad_token_id: int) -> PaddedBatch:
    """Right-pad `samples` to the longest one."""
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    L = max(len(s) for s in samples)
    B = len(samples)
    input_ids = np.full((B, L), pad_token_id, dtype=np.int64)
    labels = np.full((B, L), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((B, L), dtype=np.int64)
    types = np.zeros((B, L), dtype=np.int32)
    for b, s in enumerate(samples):
        n = len(s)
        input_ids[b, :n] = s.input_ids
        labels[b, :n] = shifted_labels(s.labels)
        mask[b, :n] = 1
        types[b, :n] = s.mm_token_type_ids
    visuals = [s.hf_visuals() for s in samples]

    def cat(name):
        parts = [v[name] for v in visuals if v[name] is not None]
        return torch.from_numpy(np.concatenate(parts)) if parts else None

    image_grid = cat("image_grid_thw")
    return PaddedBatch(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        attention_mask=torch.from_numpy(mask),
        mm_token_type_ids=torch.from_numpy(types),
        image_grid_thw=torch.zeros((0, 3), dtype=torch.int64) if image_grid is None else image_grid,
        pixel_values=cat("pixel_values"),
        pixel_values_videos=cat("pixel_values_videos"),
        video_grid_thw=cat("video_grid_thw"),
        second_per_grid_ts=cat("second_per_grid_ts"),
        sample_keys=[s.key for s in samples],
        num_label_tokens=int((labels != IGNORE_INDEX).sum()),
    )
