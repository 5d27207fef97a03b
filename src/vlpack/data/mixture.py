"""Weighted mixtures of sources (`data.mix`): one dataset drawn from several by weight.

An epoch of a mixture has as many samples as its sources together (N = Σ n_s); source s
contributes c_s = w_s / Σw · N of them (largest remainders, so the c_s sum to N). A source
with c_s ≥ n_s gives every sample ⌊c_s / n_s⌋ times and r_s = c_s mod n_s draws for the rest
(upsampling); one with c_s < n_s gives r_s = c_s draws (downsampling). The draws of a source
run through its seeded permutations one after another, epoch e taking draws e·r_s to
(e+1)·r_s − 1, so across epochs a down-weighted source gives every row before it repeats one.
The entries are interleaved by a seeded permutation that is the same every epoch (entry i is
from the same source in every epoch; its row may change), so an epoch's mixture is a list of
(source, row) pairs, a pure function of the sources' sizes, the weights, the seed and the
epoch. The bin stream shuffles and plans it like any dataset (`stream.py`, with the sizes of
the epoch's rows: `EntrySizes`), so resuming the stream (one integer, the bins consumed)
resumes the mixture exactly; each entry is a distinct index there, so an upsampled sample's
copies are planned as separate samples.

    >>> mixture_counts([3, 1], [1.0, 1.0])   # N = 4, half from each
    [2, 2]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vlpack.data.types import BadSampleError, Conversation

Item = Conversation | BadSampleError
_SALT = 0x6D6978  # "mix": the mixture's draws use their own stream of the seed


def mixture_counts(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Samples each source contributes to one epoch of N = Σ sizes: N · w_s / Σw, rounded by
    largest remainders (ties to the earlier source) so they sum to N."""
    if len(sizes) != len(weights) or not sizes:
        raise ValueError("a mixture needs one weight per source, and at least one source")
    if any(not w > 0 for w in weights):
        raise ValueError(f"data.mix weights must be positive, got {list(weights)}")
    n, total = sum(sizes), float(sum(weights))
    exact = [n * w / total for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda s: (counts[s] - exact[s], s))
    for s in by_remainder[: n - sum(counts)]:
        counts[s] += 1
    return counts


def _draws(n: int, seed: int, source: int, start: int, count: int) -> np.ndarray:
    """Draws start, ..., start + count − 1 of a source of n rows: its seeded permutations one
    after another (the k-th seeded with k, the first without)."""
    out, k = [], start // n
    while sum(len(o) for o in out) < count:
        key = [seed, _SALT, source] + ([k] if k else [])
        out.append(np.random.default_rng(key).permutation(n)[(start - k * n if not out else 0):])
        k += 1
    return np.concatenate(out)[:count] if out else np.zeros(0, dtype=np.int64)


def mixture_index(sizes: Sequence[int], weights: Sequence[float], seed: int,
                  epoch: int = 0) -> np.ndarray:
    """The mixture's entries in `epoch`, [N, 2] int64 rows of (source, row in that source),
    interleaved."""
    parts = []
    for s, (n, c) in enumerate(zip(sizes, mixture_counts(sizes, weights), strict=True)):
        if n == 0:
            raise ValueError(f"data.mix source {s} holds no samples")
        rows = np.concatenate([np.tile(np.arange(n), c // n),
                               _draws(n, seed, s, epoch * (c % n), c % n)])
        parts.append(np.stack([np.full(len(rows), s), rows], axis=1))
    index = np.concatenate(parts).astype(np.int64)
    return index[np.random.default_rng([seed, _SALT]).permutation(len(index))]


class Mixture(Sequence[Item]):
    """The items of a weighted mixture (see the module docstring): `mixture[i]` is row
    `index[i, 1]` of source `index[i, 0]`; `source_name(i)` names its source."""

    def __init__(self, sources: Sequence[Sequence[Item]], names: Sequence[str],
                 weights: Sequence[float], seed: int, *, _part: slice = slice(None)):
        if len(set(names)) != len(names):
            raise ValueError(f"data.mix names its sources {list(names)}: give each a distinct "
                             "name")
        self.sources, self.names, self.weights = list(sources), list(names), list(weights)
        self.seed, self._part = seed, _part
        self._epochs: dict[int, np.ndarray] = {}
        self.index = self.epoch_index(0)
        """Epoch 0's entries (the sources of every epoch's entries)."""

    def epoch_index(self, epoch: int) -> np.ndarray:
        """The entries of `epoch`, [N, 2] rows of (source, row)."""
        if epoch not in self._epochs:
            if len(self._epochs) > 2:  # the stream reads one epoch at a time
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = mixture_index([len(s) for s in self.sources], self.weights,
                                                self.seed, epoch)[self._part]
        return self._epochs[epoch]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            sub = range(sum(len(s) for s in self.sources))[self._part][i]
            return Mixture(self.sources, self.names, self.weights, self.seed,
                           _part=slice(sub.start, sub.stop, sub.step))
        return self.at(i, 0)

    def at(self, i: int, epoch: int) -> Item:
        """Entry `i` in `epoch`."""
        s, row = self.epoch_index(epoch)[i]
        return self.sources[s][int(row)]

    def source_name(self, i: int) -> str:
        """The name of the source entry `i` is drawn from."""
        return self.names[self.index[i, 0]]

    def measure(self, measure: Callable[[Sequence[Item]], Sequence[Any]]) -> EntrySizes:
        """Per-entry sizes from `measure` run once per source (an upsampled row is measured
        once, however often it is drawn)."""
        return EntrySizes(self, [measure(s) for s in self.sources])


class EntrySizes(Sequence[Any]):
    """The sizes of a mixture's entries: epoch 0's by index, any epoch's by `of_epoch`, from
    the sizes of every row of each source (`per_source`)."""

    def __init__(self, mixture: Mixture, per_source: Sequence[Sequence[Any]]):
        self.mixture, self.per_source = mixture, per_source

    def __len__(self) -> int:
        return len(self.mixture)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return EntrySizes(self.mixture[i], self.per_source)
        s, row = self.mixture.index[i]
        return self.per_source[s][int(row)]

    def of_epoch(self, epoch: int) -> list[Any]:
        """The entries' sizes in `epoch`."""
        return [self.per_source[s][row] for s, row in self.mixture.epoch_index(epoch).tolist()]
