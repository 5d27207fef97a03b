"""`train.epochs`: the optimizer steps that cover a number of passes over the training set.

The planner runs the training stream ahead (the same endless stream of bins, epochs chained,
with the same seed, shuffle, buffers and admission) until every sample of the first `epochs`
passes sits in a bin (trained, truncated or skipped); the steps are those bins over the bins
one step takes on all data-parallel ranks, rounded up. The count depends only on the data and
the settings, so a resumed run computes the same one.
"""

from __future__ import annotations

import math

from vlpack.data.stream import BinStream


def planned_bins(loader, epochs: int) -> int:
    """The bins of `loader`'s (a `PackedLoader`) training stream up to the one that holds the
    last sample of pass `epochs` (a sample's carry may put it a few bins into the next pass)."""
    stream = BinStream(sizes=loader.sizes, describe=loader._describe,
                       **{**loader.stream_kw, "epochs": None})
    left = epochs * len(loader.sizes)  # samples of the first `epochs` passes not yet in a bin
    for n, b in enumerate(stream, 1):
        left -= sum(e < epochs for e in b.epochs) + sum(s.epoch < epochs for s in b.skips)
        if left == 0:
            return n
    raise AssertionError("the training stream is endless")


def steps_for_epochs(loader, epochs: int, *, dp: int, micro_batches: int) -> tuple[int, int]:
    """(optimizer steps, planned bins) of `epochs` passes: ceil(bins / (dp × micro_batches)).
    ValueError for a loader whose dataset size is not known up front (Energon)."""
    if not hasattr(loader, "sizes"):
        raise ValueError("train.epochs needs the dataset's size up front, which a streamed "
                         "data.source=energon dataset does not give: set train.max_steps instead")
    bins = planned_bins(loader, epochs)
    return max(math.ceil(bins / (dp * micro_batches)), 1), bins
