"""Weighted mixtures of sources (`data.mix`): one dataset drawn from several by weight.

An epoch of a mixture has as many samples as its sources together (N = Σ n_s); source s
contributes c_s = w_s / Σw · N of them (largest remainders, so the c_s sum to N). A source
with c_s ≥ n_s gives every sample ⌊c_s / n_s⌋ times and a seeded draw without replacement for
the rest (upsampling); one with c_s < n_s gives a seeded draw of c_s samples (downsampling: the
same draw every epoch). The draws are then interleaved by a seeded permutation, so the mixture
is a fixed list of (source, row) pairs, a pure function of the sources' sizes, the weights and
the seed. The bin stream shuffles and plans it like any dataset (`stream.py`), so resuming the
stream (one integer, the bins consumed) resumes the mixture exactly; each entry is a distinct
index there, so an upsampled sample's copies are planned as separate samples.

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


def mixture_index(sizes: Sequence[int], weights: Sequence[float], seed: int) -> np.ndarray:
    """The mixture's entries, [N, 2] int64 rows of (source, row in that source), interleaved."""
    parts = []
    for s, (n, c) in enumerate(zip(sizes, mixture_counts(sizes, weights), strict=True)):
        if n == 0:
            raise ValueError(f"data.mix source {s} holds no samples")
        rng = np.random.default_rng([seed, _SALT, s])
        rows = np.concatenate([np.tile(np.arange(n), c // n), rng.permutation(n)[: c % n]])
        parts.append(np.stack([np.full(len(rows), s), rows], axis=1))
    index = np.concatenate(parts).astype(np.int64)
    return index[np.random.default_rng([seed, _SALT]).permutation(len(index))]


class Mixture(Sequence[Item]):
    """The items of a weighted mixture (see the module docstring): `mixture[i]` is row
    `index[i, 1]` of source `index[i, 0]`; `source_name(i)` names its source."""

    def __init__(self, sources: Sequence[Sequence[Item]], names: Sequence[str],
                 weights: Sequence[float], seed: int, *, _index: np.ndarray | None = None):
        if len(set(names)) != len(names):
            raise ValueError(f"data.mix names its sources {list(names)}: give each a distinct "
                             "name")
        self.sources, self.names, self.weights = list(sources), list(names), list(weights)
        self.index = _index if _index is not None else mixture_index(
            [len(s) for s in self.sources], self.weights, seed)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Mixture(self.sources, self.names, self.weights, 0, _index=self.index[i])
        s, row = self.index[i]
        return self.sources[s][int(row)]

    def source_name(self, i: int) -> str:
        """The name of the source entry `i` is drawn from."""
        return self.names[self.index[i, 0]]

    def measure(self, measure: Callable[[Sequence[Item]], list[Any]]) -> list[Any]:
        """Per-entry sizes from `measure` run once per source (an upsampled row is measured
        once, however often it is drawn)."""
        per_source = [measure(s) for s in self.sources]
        return [per_source[s][row] for s, row in self.index.tolist()]
