"""Data-parallel balancing (`vlpack.data.plan.ranks`): the cost of a bin and bins split over
ranks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlpack.data.plan import assign_bins_to_ranks, estimate_bin_cost

# ----------------------------------------------------------------- data-parallel helpers


def test_estimate_bin_cost_terms():
    assert estimate_bin_cost([10, 20], 0, attn_cost=0.0) == 30.0
    assert estimate_bin_cost([10, 20], 8, token_cost=0, attn_cost=1, patch_cost=0.5) == 504.0
    # One 8k sample costs more than eight 1k samples: the attention term.
    assert estimate_bin_cost([8192], 0) > estimate_bin_cost([1024] * 8, 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e6), max_size=40), st.integers(1, 8))
def test_assign_bins_to_ranks(costs, world):
    costs = costs[: len(costs) - len(costs) % world]
    out = assign_bins_to_ranks(costs, world)
    assert len(out) == world
    assert sorted(i for r in out for i in r) == list(range(len(costs)))
    assert len({len(r) for r in out}) <= 1, "same number of bins (steps) on every rank"
    for r in out:
        assert [costs[i] for i in r] == sorted((costs[i] for i in r), reverse=True)
    assert assign_bins_to_ranks(costs, world) == out


def test_assign_bins_balances_and_rejects_uneven():
    costs = [10, 9, 8, 7, 6, 5, 4, 3]
    out = assign_bins_to_ranks(costs, 2)
    assert [sum(costs[i] for i in r) for r in out] == [26, 26]
    assert out == [[0, 3, 4, 7], [1, 2, 5, 6]]
    with pytest.raises(ValueError, match="multiple of world_size"):
        assign_bins_to_ranks([1.0, 2.0, 3.0], 2)
