"""Context-parallel split of one packed row: which tokens each of `cp` ranks holds, and which
keys each of its query chunks attends to (pure functions over segment lengths, no torch).

Causal attention makes late tokens dearer than early ones, so a row cut into `cp` contiguous
parts would give the last rank most of the work. As in Megatron-LM and Transformer Engine, each
segment (one sample) is cut into 2·cp equal chunks and rank r holds chunks r and 2·cp−1−r: an
early and a late chunk, the same causal work on every rank. A chunk's queries attend to the
keys of its own segment from the segment's start through the chunk's end (the key/value side is
gathered from all ranks), so every rank needs, per chunk, the query range in its local tokens
and the key range in the row. Segment lengths must be multiples of 2·cp
(`data.pad_to_multiple_of`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueryChunk:
    """One chunk of a rank's queries: local tokens [q_start, q_start + length) are the row's
    tokens [row_start, row_start + length), attending to the row's keys [k_start, k_end)."""

    q_start: int
    row_start: int
    length: int
    k_start: int
    k_end: int


@dataclass(frozen=True, slots=True)
class ContextShard:
    """What rank `rank` of a context-parallel group holds of one row."""

    rank: int
    chunks: tuple[QueryChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def token_index(self) -> list[int]:
        """The row positions of this rank's tokens, in local order."""
        return [c.row_start + i for c in self.chunks for i in range(c.length)]

    @property
    def causal_pairs(self) -> int:
        """(query, key) pairs of this rank's attention: its share of the causal work."""
        return sum(sum(range(c.row_start - c.k_start + 1, c.row_start - c.k_start + c.length + 1))
                   for c in self.chunks)


def split_row(lengths: list[int], cp: int) -> list[ContextShard]:
    """The `cp` shards of a row whose segments have `lengths` (in row order); each length a
    multiple of 2·cp. ValueError names the segment otherwise."""
    if cp < 1:
        raise ValueError(f"context parallel size must be at least 1, got {cp}")
    parts = 2 * cp
    for i, n in enumerate(lengths):
        if n <= 0 or n % parts:
            raise ValueError(
                f"segment {i} has {n} tokens, not a positive multiple of 2·cp = {parts}: set "
                f"data.pad_to_multiple_of to a multiple of {parts}")
    chunks: list[list[QueryChunk]] = [[] for _ in range(cp)]
    local = [0] * cp
    start = 0
    for n in lengths:
        size = n // parts
        for rank in range(cp):
            for c in (rank, parts - 1 - rank):
                row_start = start + c * size
                chunks[rank].append(QueryChunk(local[rank], row_start, size, start,
                                               row_start + size))
                local[rank] += size
        start += n
    return [ContextShard(rank, tuple(c)) for rank, c in enumerate(chunks)]
