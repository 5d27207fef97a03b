"""The boundary contract of one forward: `Boundaries`, built once per packed row from the batch's
host data and passed to every layer as an argument.

`packed_forward` calls the base model with `vlpack_bounds=Boundaries(...)`. transformers
forwards the model call's extra keyword arguments to every decoder layer and attention call and,
through `get_image_features`, to the vision tower and its blocks, the way it forwards
`cu_seq_lens_q`; vlpack's attention function, its Gated-DeltaNet kernels, the vision attention
and the deepstack merge read their boundaries from it. Each stream's boundaries are held twice:
on the device (what the kernels take) and as Python ints (what the host needs to loop over
segments or size a kernel), so no layer reads a boundary tensor back from the device.

A forward without `vlpack_bounds` (a stock model, the unpacked reference) takes transformers'
own path in every seam.

Legend: S = segments, N = image tokens of the row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from vlpack.families import TESTED_TRANSFORMERS

BOUNDS_KWARG = "vlpack_bounds"
"""The keyword of the base-model call that carries the `Boundaries`."""


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait (pinned, non-blocking)."""
    if device.type == "cpu":
        return t
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, slots=True, eq=False)
class Segments:
    """Boundaries of one stream: `cu` int32 on the device, the same as Python ints, and the
    longest segment."""

    cu: torch.Tensor
    host: tuple[int, ...]
    max_len: int

    @classmethod
    def from_host(cls, host: tuple[int, ...], device: torch.device) -> Segments:
        host = tuple(int(x) for x in host)
        cu = to_device(torch.tensor(host, dtype=torch.int32), torch.device(device))
        return cls(cu, host, max_segment(host))

    def check(self, T: int, what: str) -> None:
        """ValueError unless the segments split a row of `T` tokens into non-empty pieces."""
        h = self.host
        if h[0] != 0 or h[-1] != T or any(b <= a for a, b in itertools.pairwise(h)):
            raise ValueError(f"{what} boundaries {list(h)} do not split a row of {T} tokens into "
                             "non-empty segments: pass the batch's cu_seqlens_padded")


@dataclass(frozen=True, slots=True, eq=False)
class VisionTables:
    """What the vision tower would derive from `grid_thw` on the device, computed on the host:
    the keyword arguments its helpers take precomputed (`tables`), the attention boundaries of
    its full (and, for Qwen2.5-VL, windowed) layers, and the grids themselves on the host."""

    tables: dict[str, Any]
    full: Segments
    window: Segments | None
    grid: torch.Tensor  # the grids, int64 [I, 3] on the host

    def segments(self, cu: torch.Tensor) -> Segments:
        """The `Segments` whose device tensor `cu` is (the tower passes one of ours per block).
        Boundaries of other values than this row's are a vlpack bug (tables kept from another
        forward: StaleVisionTablesError); equal values that are not our tensor, a tower that
        computes its own (a transformers version vlpack does not support)."""
        for s in (self.full, self.window):
            if s is not None and cu is s.cu:
                return s
        got = tuple(cu.tolist())  # the error path only: a host read of a device tensor
        if not any(s is not None and s.host == got for s in (self.full, self.window)):
            raise StaleVisionTablesError(
                "the vision attention got image boundaries that are not this row's: vlpack's "
                "vision tables (model/vision.py, built per forward from the row's grids) were "
                "kept from another forward (a vlpack bug), or this transformers version's tower "
                f"computes its own (not supported; tested: {TESTED_TRANSFORMERS})")
        raise ValueError("the vision attention got boundaries that vlpack did not build, of this "
                         "row's values: this transformers version's vision tower computes its own "
                         f"(not supported; tested: {TESTED_TRANSFORMERS}), or vlpack kept tables of another "
                         "row of the same image sizes (a vlpack bug)")


class StaleVisionTablesError(RuntimeError):
    """A vision block got image boundaries other than its row's (vision tables kept from another
    forward: a vlpack bug, which `vlpack check` reports as a failure)."""


class Boundaries:
    """Everything the layers of one packed forward need about its samples; not changed after
    construction.

    With `context` (a `vlpack.model.context.ContextSplit`) the layers hold one rank's share
    of the row: `text` is None, and the layers take the row's boundaries from the split.

    `paths` is filled by the layers with the kernel each one ran (attention, Gated-DeltaNet,
    vision tables); the forward returns it.

    A plain class, not a frozen dataclass: torch.compile looks inside a frozen dataclass handed
    to a compiled layer and guards on its fields (the host boundaries, new every row), which
    recompiles the layer for every bin; it passes this object through untouched.
    """

    __slots__ = (
        "_memo",
        "context",
        "image_index",
        "paths",
        "text",
        "vision",
    )

    def __init__(self, text: Segments | None, vision: VisionTables | None = None,
                 image_index: torch.Tensor | None = None, context: Any = None) -> None:
        self.text = text
        self.context = context  # this rank's share of a context-parallel row (context.py)
        self.vision = vision
        self.image_index = image_index  # row positions of the image tokens (deepstack)
        self.paths: dict[str, str] = {}
        self._memo: dict[str, Any] = {}

    @property
    def row(self) -> Segments | None:
        """The whole row's segments: `text`, or the context-parallel split's."""
        return self.text if self.context is None else self.context.row_segments

    def fla_cu(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's boundaries (`row`) as fla takes them: int64 on `device` and int64 on the host. The
        same two tensor objects for every layer of this forward: fla caches its chunk indices
        by argument identity, so it builds them once per forward, not once per layer."""
        key = f"fla:{device}"
        if key not in self._memo:
            host = torch.tensor(self.row.host, dtype=torch.long)
            self._memo[key] = (to_device(host, torch.device(device)), host)
        return self._memo[key]

    def fla_chunks(self, device: torch.device, chunk: int) -> torch.Tensor:
        """fla's chunk indices of the row (`row`), built on the host and moved without a wait:
        one (segment, chunk within the segment) pair per `chunk`-token chunk, int64 [chunks, 2],
        the layout of fla's `prepare_chunk_indices`. fla builds the same pairs on the host
        from `cu_seqlens_cpu` but then copies them with a blocking copy, which waits for
        everything queued before it (the whole vision tower) once per forward."""
        key = f"fla_chunks:{device}:{chunk}"
        if key not in self._memo:
            pairs = [(s, i) for s, (a, b) in enumerate(itertools.pairwise(self.row.host))
                     for i in range(-(-(b - a) // chunk))]
            host = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
            self._memo[key] = to_device(host, torch.device(device))
        return self._memo[key]


def max_segment(bounds: tuple[int, ...]) -> int:
    return max(b - a for a, b in itertools.pairwise(bounds))
