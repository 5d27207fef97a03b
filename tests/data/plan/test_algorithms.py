"""Offline bin planners: exactness against slow references, invariants, errors."""

from __future__ import annotations

import random
from bisect import bisect_right
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlpack.data.plan import (
    ALGOS,
    bin_stats,
    plan_bins,
    trees,
)

# ----------------------------------------------------------------- slow, obviously-right references


def ref_greedy(lens, cap, pats=None, max_p=None):
    """The recipe as written: stable ascending sort, then per bin take the rightmost item that
    fits (tokens by bisect, then walk left for the patch budget)."""
    pats = pats or [0] * len(lens)
    max_p = 0 if max_p is None else max_p
    items = sorted(range(len(lens)), key=lambda i: lens[i])
    sorted_lens = [lens[i] for i in items]
    bins = []
    while items:
        room, proom, b = cap, max_p, []
        while True:
            k = bisect_right(sorted_lens, room) - 1
            while k >= 0 and pats[items[k]] > proom:
                k -= 1
            if k < 0:
                break
            i = items.pop(k)
            sorted_lens.pop(k)
            b.append(i)
            room -= lens[i]
            proom -= pats[i]
        bins.append(b)
    return bins


def ref_fit(lens, cap, pats=None, max_p=None, best=False):
    """First/best fit decreasing by linear scans over all bins."""
    pats = pats or [0] * len(lens)
    max_p = 0 if max_p is None else max_p
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    bins, room, proom = [], [], []
    for i in order:
        fits = [j for j in range(len(bins)) if room[j] >= lens[i] and proom[j] >= pats[i]]
        if not fits:
            bins.append([i])
            room.append(cap - lens[i])
            proom.append(max_p - pats[i])
            continue
        j = min(fits, key=lambda j: (room[j], j)) if best else fits[0]
        bins[j].append(i)
        room[j] -= lens[i]
        proom[j] -= pats[i]
    return bins


REFS = {
    "greedy": ref_greedy,
    "ffd": ref_fit,
    "bfd": lambda *a: ref_fit(*a, best=True),
}


def next_fit(lens, cap):
    bins, fill = [[]], 0
    for i, v in enumerate(lens):
        if fill + v > cap:
            bins.append([])
            fill = 0
        bins[-1].append(i)
        fill += v
    return bins


def receipts(n, seed):
    """Synthetic receipt-like sizes: text 150-600 + 0/1/2 images of 100-2000 tokens each
    (log-uniform; 15% / 70% / 15%); 4 ViT patches per image token (2x2 merge)."""
    rng = np.random.default_rng(seed)
    text = rng.integers(150, 601, n)
    k = rng.choice(3, size=n, p=[0.15, 0.7, 0.15])
    img = np.exp(rng.uniform(np.log(100), np.log(2000), (n, 2))).astype(int)
    img_tok = (img * (np.arange(2)[None, :] < k[:, None])).sum(1)
    return (text + img_tok).tolist(), (4 * img_tok).tolist()


# ----------------------------------------------------------------- strategies

CAP = 64
items = st.lists(
    st.tuples(st.integers(1, CAP), st.integers(0, 40)), min_size=0, max_size=60
)


def check_partition(bins, n, lens, cap, pats=None, max_p=None):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(n)), "every item exactly once"
    assert all(b for b in bins), "no empty bin"
    for b in bins:
        assert sum(lens[i] for i in b) <= cap
        if max_p is not None:
            assert sum(pats[i] for i in b) <= max_p


# ----------------------------------------------------------------- properties


@contextmanager
def scan_limit(limit):
    """Planners scan `limit` items or bins before they build a tree (1: the trees answer nearly
    every patch miss and first fit's record repairs)."""
    saved = trees.SCAN_LIMIT
    trees.SCAN_LIMIT = limit
    try:
        yield
    finally:
        trees.SCAN_LIMIT = saved


def plan_with_trees(*args, **kw):
    with scan_limit(1):
        return plan_bins(*args, **kw)


@settings(max_examples=80, deadline=None)
@given(items, st.sampled_from(ALGOS), st.booleans())
def test_partition_budgets_and_reference(data, algo, two_budgets):
    lens = [t for t, _ in data]
    pats = [p for _, p in data]
    max_p = 40 if two_budgets else None
    kw = {"patches": pats, "max_patches": max_p} if two_budgets else {}
    bins = plan_bins(lens, CAP, algo, **kw)
    assert plan_with_trees(lens, CAP, algo, **kw) == bins, "scans and patch trees agree"
    check_partition(bins, len(lens), lens, CAP, pats, max_p)
    args = (lens, CAP, pats, max_p) if two_budgets else (lens, CAP)
    assert bins == REFS[algo](*args)
    assert plan_bins(lens, CAP, algo, **kw) == bins, "deterministic"


@settings(max_examples=30, deadline=None)
@given(items, st.sampled_from(ALGOS), st.integers(0, 2**31))
def test_seed_shuffles_bin_order_only(data, algo, seed):
    lens = [t for t, _ in data]
    plain = plan_bins(lens, CAP, algo)
    seeded = plan_bins(lens, CAP, algo, seed=seed)
    assert sorted(seeded) == sorted(plain)
    assert plan_bins(lens, CAP, algo, seed=seed) == seeded


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, CAP), min_size=1, max_size=30), st.sampled_from(ALGOS),
       st.data())
def test_overlong_item_raises_naming_it(lens, algo, data):
    bad = data.draw(st.integers(0, len(lens) - 1))
    lens = [*lens[:bad], CAP + 1, *lens[bad + 1 :]]
    with pytest.raises(ValueError, match=rf"item {bad} has {CAP + 1} tokens.*overlong policy"):
        plan_bins(lens, CAP, algo)


@pytest.mark.parametrize("algo", ALGOS)
def test_too_many_patches_raises(algo):
    with pytest.raises(ValueError, match=r"item 1 has 9 ViT patches > max_patches 8"):
        plan_bins([3, 3, 3], 10, algo, patches=[0, 9, 1], max_patches=8)


def test_input_errors():
    with pytest.raises(ValueError, match=r"choose one of \['bfd', 'ffd', 'greedy'\]"):
        plan_bins([1], 8, "nfd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass patches="):
        plan_bins([1], 8, "ffd", max_patches=4)
    with pytest.raises(ValueError, match="item 1 has length 0"):
        plan_bins([1, 0], 8, "ffd")
    with pytest.raises(ValueError, match="patches has 1 entries"):
        plan_bins([1, 2], 8, "ffd", patches=[0], max_patches=4)


def test_numpy_input_and_empty():
    lens = np.array([5, 3, 2, 7], dtype=np.int32)
    for algo in ALGOS:
        assert plan_bins(lens, 10, algo) == plan_bins(lens.tolist(), 10, algo)
        assert plan_bins([], 10, algo) == []


# ----------------------------------------------------------------- hand-worked cases


def test_greedy_knapsack_hand_worked():
    # lengths   idx: 0  1  2  3  4  5 ; capacity 10 ; ascending: 1(5) 2(2) 3(3) 3(4) 5(1) 8(0)
    # bin 0: take 8 (idx 0), room 2 → take 2 (idx 2)                         → [0, 2]
    # bin 1: take 5 (idx 1), room 5 → 3 (idx 4: equal lengths, highest index first) → room 2,
    #        no 3 left that fits, 1 (idx 5)                                    → [1, 4, 5]
    # bin 2: the other 3 (idx 3)                                               → [3]
    assert plan_bins([8, 5, 2, 3, 3, 1], 10, "greedy") == [[0, 2], [1, 4, 5], [3]]


def test_first_fit_decreasing_hand_worked():
    # descending: 6(0) 5(1) 4(2) 3(3) 3(4) 2(5) 1(6) into 10
    # 6→b0(4) 5→b1(5) 4→b0(0) 3→b1(2) 3→b2(7) 2→b1(0) 1→b2(6)
    assert plan_bins([6, 5, 4, 3, 3, 2, 1], 10, "ffd") == [[0, 2], [1, 3, 5], [4, 6]]


def test_best_fit_decreasing_hand_worked():
    # cap 12, descending 9(0) 7(1) 4(2) 1(3): 9→b0 room 3 ; 7→b1 room 5 ; 4→b1 room 1 ;
    # 1 → FFD: b0 (first that fits) ; BFD: b1 (room 1 is tighter than b0's 3).
    assert plan_bins([9, 7, 4, 1], 12, "ffd") == [[0, 3], [1, 2]]
    assert plan_bins([9, 7, 4, 1], 12, "bfd") == [[0], [1, 2, 3]]
    # Equal rooms tie to the lowest bin: 5(0)→b0 r3, 5(1)→b1 r3, 3(2)→b0.
    assert plan_bins([5, 5, 3], 8, "bfd") == [[0, 2], [1]]


def test_two_budget_hand_worked():
    # cap 10 tokens, 8 patches. Greedy: bin 0 takes 6 (idx 0, 6 patches), room 4/2 → 4 (idx 1)
    # has 4 patches > 2, skip to 3 (idx 2, 0 patches) → room 1/2 → 1 (idx 3). bin 1: 4.
    lens, pats = [6, 4, 3, 1], [6, 4, 0, 0]
    for algo in ALGOS:
        assert plan_bins(lens, 10, algo, patches=pats, max_patches=8) == [[0, 2, 3], [1]]
    # Without the patch budget the 4 joins the 6.
    assert plan_bins(lens, 10, "greedy") == [[0, 1], [2, 3]]


# ----------------------------------------------------------------- fast paths and quality


def random_items(n, cap, max_p, rng):
    """Mostly short items, a few long ones (up to the capacity); a quarter of the items
    (text-only) carry no patches, the others up to 60."""
    lens = [rng.randint(1, cap) if rng.random() < 0.03 else rng.randint(1, max(cap // 40, 4))
            for _ in range(n)]  # fmt: skip
    pats = [0 if rng.random() < 0.25 else rng.randint(0, min(max_p, 60)) for _ in range(n)]
    return lens, pats


@pytest.mark.parametrize("limit", [trees.SCAN_LIMIT, 1])
@pytest.mark.parametrize(
    ("n", "cap", "max_p"),
    [(0, 16, 50), (1, 1000, 0), (7, 16, 50), (60, 16, 50), (300, 16, 50), (300, 8192, 1000),
     (4500, 1000, 500)],
)  # fmt: skip
def test_matches_reference_on_random_inputs(n, cap, max_p, limit):
    """Several sizes (4,500 > the 4,096-item buffer), with and without a patch budget that
    binds in most bins; capacity 16 makes many bins tie on free tokens. With limit 1 the trees
    answer nearly every search that would scan."""
    lens, pats = random_items(n, cap, max_p, random.Random(n + cap))
    for algo in ALGOS:
        with scan_limit(limit):
            one = plan_bins(lens, cap, algo)
            two = plan_bins(lens, cap, algo, patches=pats, max_patches=max_p)
        assert one == REFS[algo](lens, cap)
        assert two == REFS[algo](lens, cap, pats, max_p)


@pytest.mark.parametrize("algo", ALGOS)
def test_fill_beats_next_fit_on_receipts(algo):
    lens, pats = receipts(2000, seed=3)
    naive = bin_stats(next_fit(lens, 8192), lens, 8192)
    stats = bin_stats(plan_bins(lens, 8192, algo), lens, 8192)
    assert stats["bins"] <= naive["bins"]
    assert stats["efficiency"] >= 0.99 > naive["efficiency"]
    two = plan_bins(lens, 8192, algo, patches=pats, max_patches=16384)
    check_partition(two, len(lens), lens, 8192, pats, 16384)
