"""Fill statistics of planned bins (`vlpack.data.plan.stats`)."""

from __future__ import annotations

import pytest

from vlpack.data.plan import bin_stats


def test_bin_stats():
    s = bin_stats([[0, 1], [2]], [3, 5, 4], 10)
    assert s == pytest.approx({"bins": 2, "items": 3, "tokens": 12, "efficiency": 0.6,
                               "mean_fill": 0.6, "min_fill": 0.4, "max_fill": 0.8})
