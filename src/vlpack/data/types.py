"""The contracts between the data stages.

source (`Conversation`) → encode (`EncodedSample`, or `SampleSize` without decoding pixels)
→ plan (lists of lengths → bins of indices) → batch (`ThdBatch`, see batch.py).

Shape legend: L = tokens of one sample, I = visual items (images and videos) of one sample,
P = ViT patches of one sample, C = channels × temporal patch × patch² (the flattened patch
dimension).
"""

from __future__ import annotations

import re
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
    """An image a conversation refers to: an absolute path on disk, or the encoded bytes a
    Hugging Face dataset holds (`data`; `path` then only names it in messages)."""

    path: Path
    data: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class VideoRef:
    """A video a conversation refers to: a container file (`path`) or a list of frame images
    (`frames`, a video already sampled at `fps`), absolute paths. `fps` of a file overrides the
    rate its header gives."""

    path: Path | None = None
    frames: tuple[Path, ...] = ()
    fps: float | None = None

    def __post_init__(self) -> None:
        assert (self.path is None) == bool(self.frames), "a VideoRef is a file or frames"

    @property
    def name(self) -> str:
        """How messages name it: the file, or the first frame and the count."""
        if self.path is not None:
            return str(self.path)
        return f"{self.frames[0]} (+{len(self.frames) - 1} frames)"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant turn makes: the function's name and its arguments (a JSON
    object, keys in the order the data gives them)."""

    name: str
    arguments: dict


@dataclass(frozen=True, slots=True)
class Message:
    """One turn. `content` interleaves text (str), images and videos in reading order."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: tuple[str | ImageRef | VideoRef, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    """The function calls of an assistant turn, written after its text."""
    loss: bool = True
    """Whether an assistant turn is supervised (`"loss": false` in the data masks it); system,
    user and tool turns never are."""
    reasoning: str | None = None
    """An assistant turn's reasoning given apart from its text (`reasoning_content`), which a
    template with a think block writes there; None: the text may hold `<think>...</think>`."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """One training sample as read from a source, before tokenisation.

    `key` is stable across runs: the `id` field of the record, else `file:line`.
    """

    key: str
    messages: tuple[Message, ...]
    where: str | None = field(default=None, compare=False)
    """`file:line` the record was read from, when the key is its `id` (None otherwise)."""
    tools: tuple[dict, ...] = ()
    """The functions the assistant may call: JSON function schemas (`{"type": "function",
    "function": {"name", "description", "parameters"}}`), as transformers'
    `apply_chat_template(..., tools=...)` takes them."""

    @property
    def name(self) -> str:
        """How messages name the sample: its key, and its `file:line` when the key is an id."""
        return self.key if self.where is None else f"{self.key} ({self.where})"

    @property
    def images(self) -> list[ImageRef]:
        return [c for m in self.messages for c in m.content if isinstance(c, ImageRef)]

    @property
    def visuals(self) -> list[ImageRef | VideoRef]:
        """Images and videos in reading order."""
        return [c for m in self.messages for c in m.content if not isinstance(c, str)]


@dataclass(frozen=True, slots=True)
class SampleSize:
    """Exact sizes of an encoded sample, known before decoding pixels.

    `tokens` is the LLM sequence length; `patches` the number of ViT patches (sum of t·h·w over
    the sample's image and video grids), `video_patches` the videos' share of them.
    """

    tokens: int
    patches: int
    video_patches: int = 0


@dataclass(slots=True)
class EncodedSample:
    """A tokenised sample, unshifted and unpadded.

    Fields (numpy, CPU):
      input_ids        [L] int64
      labels           [L] int64 — equal to input_ids on supervised tokens (the content, tool
                       calls and <|im_end|> of assistant turns with `loss`), IGNORE_INDEX
                       elsewhere. NOT shifted: the batch shifts.
      mm_token_type_ids [L] int8 — TOKEN_TYPE_* per token.
      image_grid_thw   [I, 3] int64 — (t, h, w) in patches of every visual item (image or
                       video), in the order they appear; a video's t counts temporal patches.
      pixel_values     [P, C] float32 — patches of all visual items, concatenated in that
                       order; None when the sample has none (or when only sizes were computed).
      visual_kinds     [I] int8 — TOKEN_TYPE_IMAGE or TOKEN_TYPE_VIDEO per item.
      second_per_grid  [I] float32 — seconds one temporal patch of a video spans (0 for images;
                       transformers' `second_per_grid_ts`).
      temporal_step    [I] float32 — MRoPE temporal positions per temporal patch: 1, or for a
                       Qwen2.5-VL video tokens_per_second × second_per_grid.

    The vision tower encodes images and videos alike (patches of two frames; an image is its
    frame twice), so one stream in token order serves the packed row; `hf_visuals` splits it
    into transformers' image and video inputs.
    """

    key: str
    input_ids: np.ndarray
    labels: np.ndarray
    mm_token_type_ids: np.ndarray
    image_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    pixel_values: np.ndarray | None = None
    visual_kinds: np.ndarray | None = None
    second_per_grid: np.ndarray | None = None
    temporal_step: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.image_grid_thw)
        if self.visual_kinds is None:
            self.visual_kinds = np.full(n, TOKEN_TYPE_IMAGE, dtype=np.int8)
        if self.second_per_grid is None:
            self.second_per_grid = np.zeros(n, dtype=np.float32)
        if self.temporal_step is None:
            self.temporal_step = np.ones(n, dtype=np.float32)

    @property
    def num_videos(self) -> int:
        return int((self.visual_kinds == TOKEN_TYPE_VIDEO).sum())

    def hf_visuals(self) -> dict[str, np.ndarray | None]:
        """transformers' inputs: pixel_values / image_grid_thw of the images,
        pixel_values_videos / video_grid_thw / second_per_grid_ts of the videos (None where
        the sample has none)."""
        grids, kinds = self.image_grid_thw, self.visual_kinds
        starts = np.concatenate(([0], np.cumsum(grids.prod(axis=1)))) if len(grids) else [0]
        out: dict[str, np.ndarray | None] = {}
        for kind, pix, grid in ((TOKEN_TYPE_IMAGE, "pixel_values", "image_grid_thw"),
                                (TOKEN_TYPE_VIDEO, "pixel_values_videos", "video_grid_thw")):
            items = np.flatnonzero(kinds == kind)
            out[grid] = grids[items] if len(items) else None
            out[pix] = None if not len(items) or self.pixel_values is None else np.concatenate(
                [self.pixel_values[starts[i] : starts[i + 1]] for i in items])
        videos = np.flatnonzero(kinds == TOKEN_TYPE_VIDEO)
        out["second_per_grid_ts"] = self.second_per_grid[videos] if len(videos) else None
        return out

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_patches(self) -> int:
        return int(self.image_grid_thw.prod(axis=1).sum()) if len(self.image_grid_thw) else 0

    def keep_visuals(self, n: int) -> dict:
        """Fields of the first `n` visual items (for a truncated copy)."""
        grids = self.image_grid_thw[:n]
        pixels = self.pixel_values
        if pixels is not None:
            pixels = pixels[: int(grids.prod(axis=1).sum()) if n else 0]
        return dict(image_grid_thw=grids, pixel_values=pixels,
                    visual_kinds=self.visual_kinds[:n], second_per_grid=self.second_per_grid[:n],
                    temporal_step=self.temporal_step[:n])

    @property
    def size(self) -> SampleSize:
        videos = self.visual_kinds == TOKEN_TYPE_VIDEO
        video = int(self.image_grid_thw[videos].prod(axis=1).sum()) if videos.any() else 0
        return SampleSize(tokens=len(self), patches=self.num_patches, video_patches=video)

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


def located(e: BadSampleError, conv: Conversation) -> BadSampleError:
    """`e` with the `file:line` of `conv` added when its key is an id (so it can be found)."""
    if conv.where is not None and conv.where not in str(e):
        e.args = (f"{e} [{conv.where}]",)
    return e


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` for a terminal or a log line: control characters, line separators and bidi
    overrides (which a dataset's ids and paths may hold, to forge or hide log lines) written
    as their escapes."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
