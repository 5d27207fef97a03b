"""The contracts between the data stages.

source (`Conversation`) → encode (`EncodedSample`, or `SampleSize` without decoding pixels)
→ plan (lists of lengths → bins of indices) → batch (`ThdBatch`, see batch.py).

Shape legend: L = tokens of one sample, I = images of one sample, P = ViT patches of one sample,
C = channels × temporal patch × patch² (the flattened patch dimension).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IGNORE_INDEX = -100
"""Label value that the loss ignores."""

FILLER_KEY = "<filler>"
"""Key of the placeholder sample of a bin that lost all its samples (`EncodedSample.filler`)."""

TOKEN_TYPE_TEXT, TOKEN_TYPE_IMAGE, TOKEN_TYPE_VIDEO = 0, 1, 2
"""Values of `mm_token_type_ids`, as transformers' processors emit them."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image a conversation refers to: an absolute path on disk."""

    path: Path


@dataclass(frozen=True, slots=True)
class Message:
    """One turn. `content` interleaves text (str) and images (ImageRef) in reading order."""

    role: str  # "system" | "user" | "assistant"
    content: tuple[str | ImageRef, ...]


@dataclass(frozen=True, slots=True)
class Conversation:
    """One training sample as read from a source, before tokenisation.

    `key` is stable across runs: the `id` field of the record, else `file:line`.
    """

    key: str
    messages: tuple[Message, ...]

    @property
    def images(self) -> list[ImageRef]:
        return [c for m in self.messages for c in m.content if isinstance(c, ImageRef)]


@dataclass(frozen=True, slots=True)
class SampleSize:
    """Exact sizes of an encoded sample, known before decoding pixels.

    `tokens` is the LLM sequence length; `patches` the number of ViT patches (sum of t·h·w over
    the sample's image grids).
    """

    tokens: int
    patches: int


@dataclass(slots=True)
class EncodedSample:
    """A tokenised sample, unshifted and unpadded.

    Fields (numpy, CPU):
      input_ids        [L] int64
      labels           [L] int64 — equal to input_ids on supervised tokens (assistant content and
                       its <|im_end|>), IGNORE_INDEX elsewhere. NOT shifted: the batch shifts.
      mm_token_type_ids [L] int8 — TOKEN_TYPE_* per token.
      image_grid_thw   [I, 3] int64 — (t, h, w) in patches, in the order images appear.
      pixel_values     [P, C] float32 — patches of all images, concatenated in order; None when
                       the sample has no image (or when only sizes were computed).
    """

    key: str
    input_ids: np.ndarray
    labels: np.ndarray
    mm_token_type_ids: np.ndarray
    image_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    pixel_values: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_patches(self) -> int:
        return int(self.image_grid_thw.prod(axis=1).sum()) if len(self.image_grid_thw) else 0

    @property
    def size(self) -> SampleSize:
        return SampleSize(tokens=len(self), patches=self.num_patches)

    @classmethod
    def filler(cls, pad_token_id: int) -> EncodedSample:
        """A one-token sample with no label, for a bin whose samples all failed to encode: the
        rank still takes its step, so collectives stay in lockstep."""
        return cls(
            key=FILLER_KEY,
            input_ids=np.array([pad_token_id], dtype=np.int64),
            labels=np.array([IGNORE_INDEX], dtype=np.int64),
            mm_token_type_ids=np.zeros(1, dtype=np.int8),
        )


class BadSampleError(ValueError):
    """A sample that cannot be used. `reason` is a short stable tag for counting
    (e.g. "missing_image", "no_assistant_turn"); the message names the sample and the fix."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # picklable (worker processes send it back)
        return type(self), (self.reason, str(self))
