"""Fill statistics of planned bins."""

from __future__ import annotations

from collections.abc import Sequence

from vlpack.data.plan.algorithms import _as_int_list

__all__ = ["bin_stats"]


def bin_stats(bins: Sequence[Sequence[int]], lengths: Sequence[int], capacity: int) -> dict:
    """Fill statistics: `efficiency` = real tokens / (bins × capacity); fills are per bin."""
    lens = _as_int_list(lengths, "lengths")
    fills = [sum(lens[i] for i in b) / capacity for b in bins]
    tokens = sum(sum(lens[i] for i in b) for b in bins)
    n = len(fills)
    return {
        "bins": n,
        "items": sum(len(b) for b in bins),
        "tokens": tokens,
        "efficiency": tokens / (n * capacity) if n else 0.0,
        "mean_fill": sum(fills) / n if n else 0.0,
        "min_fill": min(fills) if n else 0.0,
        "max_fill": max(fills) if n else 0.0,
    }
