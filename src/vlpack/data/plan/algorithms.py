"""Bin planning: a pure function from sample lengths to bins of sample indices.

Lengths in, groups out; no tensors (`online.py` runs it over a bounded buffer). Every item
lands in exactly one bin; a bin's token sum is ≤ `capacity` and, when `max_patches` is given,
its ViT-patch sum is ≤ `max_patches`. An item that cannot fit an empty bin raises `ValueError`:
apply the overlong policy (truncate or drop) before planning, never here.

`plan_bins(lengths, capacity, algo)` runs one of three algorithms, chosen by name (`Algo`), each
with one implementation for every input size (all deterministic; items of equal length keep a
fixed, index-based order):

- `greedy` — Megatron-Bridge/Energon's packing recipe: sort ascending (stable); fill one bin at
  a time, repeatedly taking the largest remaining item that still fits (equal lengths: highest
  index first). The distinct lengths left form one sorted list, so a pick is one bisect.
- `ffd` (first fit decreasing) — items longest first (ties: lower index first), each into the
  lowest-numbered bin it fits, else a new bin. The bins with more free tokens than every bin
  before them (the records) form one increasing list, so a search is one bisect; when a record
  shrinks, the bins up to the next record are scanned for the new records, and once such a scan
  would pass `trees.SCAN_LIMIT` bins, a max-tree over free tokens (built then) finds them.
- `bfd` (best fit decreasing) — items longest first (ties: lower index first), each into the
  bin it fits with the fewest free tokens (ties: lowest bin number), else a new bin. Bins live
  in one sorted list of keys free tokens·K + bin, so a search is one bisect; a bin with fewer
  free tokens than the shortest item leaves the list. Once a patch scan would run too far
  (below), the patch tree holds the bins instead, each leaf's bins in one short list.

With a patch budget "fits" means both budgets, and the tie rules above are unchanged. The
candidate the token rule picks is checked first; when it lacks the patches, the planner scans on
in its rule's order over at most `trees.SCAN_LIMIT` items (greedy) or bins, and once a scan would
pass that, it builds a segment tree over patch counts (trees.py) that from then on finds the
first candidate in the same order that has them. A search is a bisect, a scan of at most
`SCAN_LIMIT` candidates or a descent of a tree, never a scan over all bins or items: only bins
with equal free tokens (best fit) are scanned one by one past that, and first fit's two-budget
search backs off a subtree whose two maxima belong to different bins. Inputs whose patch budget
never binds (a generous `max_patches`) build no patch tree.

Within a bin, items appear in the order they were placed. Output bins appear in the order they
were opened, unless `seed` is given: then the list of bins is shuffled with `random.Random(seed)`
so that a stream of bins does not run from the longest items to the shortest. Bins themselves
are identical with or without a seed.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Sequence
from itertools import chain
from typing import get_args

from vlpack.config import Algo
from vlpack.data.plan import trees
from vlpack.data.plan.trees import (
    BinPatches,
    ItemPatches,
    RoomPatches,
    first_above,
    max_tree,
)

__all__ = ["ALGOS", "Algo", "check_algo", "plan_bins"]

ALGOS: tuple[Algo, ...] = get_args(Algo)
Bins = list[list[int]]


def check_algo(algo: str) -> None:
    """Raises ValueError naming the choices when `algo` is not a planner name."""
    if algo not in ALGOS:
        raise ValueError(f"unknown packing algo {algo!r}; choose one of {sorted(ALGOS)}")


def plan_bins(
    lengths: Sequence[int],
    capacity: int,
    algo: Algo,
    *,
    patches: Sequence[int] | None = None,
    max_patches: int | None = None,
    seed: int | None = None,
) -> Bins:
    """Plans `lengths` (tokens per item) into bins of at most `capacity` tokens with the named
    algorithm; returns bins of item indices.

    `patches` (ViT patches per item) only count when `max_patches` is given. `seed` shuffles the
    order of the bins (not their contents); None keeps the order in which bins were opened.

    >>> plan_bins([6, 5, 4, 3, 3, 2, 1], 10, "ffd")
    [[0, 2], [1, 3, 5], [4, 6]]
    """
    check_algo(algo)
    lens, pats = _validate(lengths, capacity, patches, max_patches)
    bins = _plan_checked(algo, lens, pats, capacity, max_patches)
    if seed is not None:
        random.Random(seed).shuffle(bins)
    return bins


def _plan_checked(
    algo: str,
    lens: Sequence[int],
    pats: Sequence[int] | None,
    capacity: int,
    max_patches: int | None,
) -> Bins:
    """Runs `algo` on validated int sequences (no checks, no shuffle): the core `plan_bins`
    and `OnlinePlanner` share. `pats` is ignored when `max_patches` is None."""
    if max_patches is None:
        pats, max_patches = None, 0
    return _RUN[algo](lens, pats, capacity, max_patches)


# --------------------------------------------------------------------------- validation


_INT = frozenset((int,))


def _as_int_list(values: Sequence[int], name: str) -> list[int]:
    """A plain list of Python ints (fast path for numpy arrays via `.tolist()`)."""
    tolist = getattr(values, "tolist", None)
    out = tolist() if callable(tolist) else list(values)
    if not _INT.issuperset(map(type, out)):  # one C pass
        if not all(float(v).is_integer() for v in out):
            raise ValueError(f"{name} must be integers; got {out[:8]}...")
        out = [int(v) for v in out]
    return out


def _first_index(values: list[int], bad: Callable[[int], bool]) -> int:
    return next(i for i, v in enumerate(values) if bad(v))


def _validate(
    lengths: Sequence[int],
    capacity: int,
    patches: Sequence[int] | None,
    max_patches: int | None,
) -> tuple[list[int], list[int] | None]:
    """Checks the inputs; returns (lengths, patches or None when patches are not budgeted)."""
    if capacity < 1:
        raise ValueError(f"capacity must be ≥ 1 token; got {capacity}")
    lens = _as_int_list(lengths, "lengths")
    if lens and min(lens) < 1:
        i = _first_index(lens, lambda v: v < 1)
        raise ValueError(
            f"item {i} has length {lens[i]}; every item needs ≥ 1 token "
            "(drop empty samples before planning)"
        )
    if lens and max(lens) > capacity:
        i = _first_index(lens, lambda v: v > capacity)
        raise ValueError(
            f"item {i} has {lens[i]} tokens > capacity {capacity}; apply the overlong policy "
            "(truncate or drop the sample) before planning, or raise the bin capacity"
        )
    if max_patches is None:
        return lens, None
    if patches is None:
        raise ValueError("max_patches is set but patches is None; pass patches= per item")
    if max_patches < 0:
        raise ValueError(f"max_patches must be ≥ 0; got {max_patches}")
    pats = _as_int_list(patches, "patches")
    if len(pats) != len(lens):
        raise ValueError(f"patches has {len(pats)} entries but lengths has {len(lens)}")
    if pats and min(pats) < 0:
        i = _first_index(pats, lambda v: v < 0)
        raise ValueError(f"item {i} has {pats[i]} patches; patch counts must be ≥ 0")
    if pats and max(pats) > max_patches:
        i = _first_index(pats, lambda v: v > max_patches)
        raise ValueError(
            f"item {i} has {pats[i]} ViT patches > max_patches {max_patches}; apply the "
            "overlong policy (downscale the images or drop the sample) before planning, "
            "or raise max_patches"
        )
    return lens, pats


# --------------------------------------------------------------------------- the algorithms
# Each takes validated lengths, patches (None: no patch budget), capacity and max_patches.


def _greedy(lens: Sequence[int], pats: Sequence[int] | None, capacity: int, max_p: int) -> Bins:
    """Items of one length form a stack (highest index on top, as a stable ascending sort
    plus a rightmost pick would take them); `vals` holds the lengths with items left, so the
    largest fitting item is one bisect away. An emptied stack is dropped at once (fewer live
    lists, fewer garbage-collector passes). A patch miss walks on in the rule's order over at
    most `trees.SCAN_LIMIT` items; after the first walk that would pass that, every miss asks
    `ItemPatches`. (The loop without a patch budget is the same loop with the patch steps left
    out.)"""
    stacks: dict[int, list[int]] = {}
    stack_of = stacks.setdefault
    for i, v in enumerate(lens):
        stack_of(v, []).append(i)
    vals = sorted(stacks)
    bins: Bins = []
    if pats is None:
        while vals:
            room = capacity
            b: list[int] = []
            k = len(vals)  # the longest item left opens the bin
            while k:
                v = vals[k - 1]
                st = stacks[v]
                b.append(st.pop())
                room -= v
                if not st:
                    del vals[k - 1], stacks[v]
                k = bisect_right(vals, room)
            bins.append(b)
        return bins
    index: ItemPatches | None = None
    limit = trees.SCAN_LIMIT
    while vals:
        room, proom = capacity, max_p
        b = []
        k = len(vals)
        while k:
            v = vals[k - 1]
            st = stacks[v]
            if pats[st[-1]] <= proom:
                i = st.pop()
                if not st:
                    del vals[k - 1], stacks[v]
            else:
                pick = None if index is not None else _walk_left(vals, stacks, pats, k - 1, proom, limit)
                if pick is not None:
                    g, at = pick
                    if g < 0:
                        break
                    v = vals[g]
                    st = stacks[v]
                    i = st.pop(at)
                    if not st:
                        del vals[g], stacks[v]
                else:  # too far: from now on the tree answers
                    if index is None:
                        index = ItemPatches(lens, pats, stacks.values())
                    i = index.rightmost(room, proom)
                    if i < 0:
                        break
                    v = lens[i]
                    st = stacks[v]
                    del st[bisect_left(st, i)]
                    if not st:
                        del vals[bisect_left(vals, v)], stacks[v]
            if index is not None:
                index.take(i)
            b.append(i)
            room -= v
            proom -= pats[i]
            k = bisect_right(vals, room)
        bins.append(b)
    return bins


def _walk_left(
    vals: list[int], stacks: dict[int, list[int]], pats: Sequence[int], g: int, budget: int,
    limit: int,
) -> tuple[int, int] | None:
    """Greedy's pick with a patch budget, walking items in the rule's order from the top of
    length vals[g]'s stack down, then on to the shorter lengths: (its index in vals, its position
    in the stack), (-1, -1) when no item has ≤ budget patches, or None after `limit` items."""
    while g >= 0:
        st = stacks[vals[g]]
        for at in range(len(st) - 1, -1, -1):
            if pats[st[at]] <= budget:
                return g, at
            limit -= 1
            if not limit:
                return None
        g -= 1
    return -1, -1


def _new_records(room: list[int], tree: list[int] | None, size: int, start: int, end: int,
                 m: int, vals: list[int], nums: list[int]) -> None:
    """Append to `vals`/`nums` the free tokens and numbers of the bins in [start, end) with
    more free tokens than `m` and every bin before them: a scan, or descents of the max-tree."""
    if tree is None:
        for k in range(start, end):
            x = room[k]
            if x > m:
                vals.append(x)
                nums.append(k)
                m = x
        return
    k = first_above(tree, size, start, m)
    while k < end:
        m = room[k]
        vals.append(m)
        nums.append(k)
        k = first_above(tree, size, k + 1, m)


def _ffd(lens: Sequence[int], pats: Sequence[int] | None, capacity: int, max_p: int) -> Bins:
    """The records are the bins with more free tokens than every bin before them (prefix
    maxima): free tokens `rv` (increasing) and bin numbers `rb`, then a sentinel (capacity + 1
    free tokens, the next bin to open). The first bin that fits is a record, so one bisect
    finds it. When a record shrinks, the bins between it and the next record that now beat
    every bin before them become records: a scan over those bins finds them until a gap passes
    `trees.SCAN_LIMIT` bins; then a max-tree over the bins' free tokens (built then, unopened
    leaves full, updated from then on) does, one descent per new record. A patch miss scans on
    from the first fit over at most `SCAN_LIMIT` bins, then builds the tree (if not yet built)
    and `BinPatches` and asks them. Other bins than records never change the records. (The
    loop without a patch budget is the same loop with the patch steps left out.)"""
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    limit = trees.SCAN_LIMIT
    room: list[int] = []
    bins: Bins = []
    rv, rb = [capacity + 1], [0]
    nb = size = 0
    tree: list[int] | None = None
    if pats is None:
        for i in order:
            s = lens[i]
            p = bisect_left(rv, s)
            j = rb[p]
            r = capacity - s if j == nb else rv[p] - s
            if tree is not None:  # bin j's leaf (an unopened one when j == nb)
                node = j + size
                v = tree[node] = r
                while node > 1:  # parents hold the max of their children
                    sib = tree[node ^ 1]
                    node >>= 1
                    v = v if v > sib else sib
                    if tree[node] == v:
                        break
                    tree[node] = v
            if j == nb:  # the sentinel: open a bin
                room.append(r)
                bins.append([i])
                nb += 1
                if tree is not None and nb == size:  # keep one unopened leaf: searches end on one
                    size <<= 1
                    tree = max_tree(room, size, capacity)
                if not p or r > rv[p - 1]:
                    rv.insert(p, r)
                    rb.insert(p, j)
                rb[-1] = nb
                continue
            room[j] = r
            bins[j].append(i)
            low = rv[p - 1] if p else -1
            end = rb[p + 1]
            if j + 1 == end:  # nothing between this record and the next
                if r > low:
                    rv[p] = r
                else:
                    del rv[p], rb[p]
                continue
            if r > low:
                new_v, new_b, m = [r], [j], r
            else:
                new_v, new_b, m = [], [], low
            if tree is None and end - j > limit:
                size = 1 << nb.bit_length()
                tree = max_tree(room, size, capacity)
            _new_records(room, tree, size, j + 1, end, m, new_v, new_b)
            rv[p : p + 1] = new_v
            rb[p : p + 1] = new_b
        return bins
    proom: list[int] = []
    index: BinPatches | None = None
    for i in order:
        s, q = lens[i], pats[i]
        p = bisect_left(rv, s)
        j = rb[p]
        if j < nb and proom[j] < q:  # a patch miss: the first fit after j with both
            j += 1
            if tree is None:
                stop = min(nb, j + limit)
                while j < stop and (room[j] < s or proom[j] < q):
                    j += 1
                if j == stop < nb:  # too far: from now on the trees answer
                    size = 1 << nb.bit_length()
                    tree = max_tree(room, size, capacity)
            if tree is not None and j < nb and (room[j] < s or proom[j] < q):
                if index is None:
                    index = BinPatches(size, proom, max_p)
                j = index.first_fit(tree, j, s, q)
            p = bisect_left(rb, j)
        r = capacity - s if j == nb else room[j] - s
        if tree is not None:  # bin j's leaf (an unopened one when j == nb)
            node = j + size
            v = tree[node] = r
            while node > 1:
                sib = tree[node ^ 1]
                node >>= 1
                v = v if v > sib else sib
                if tree[node] == v:
                    break
                tree[node] = v
        if index is not None:
            index.dirty.append(j)
        if j == nb:
            room.append(r)
            proom.append(max_p - q)
            bins.append([i])
            nb += 1
            if tree is not None and nb == size:
                size <<= 1
                tree = max_tree(room, size, capacity)
                index = None
            if not p or r > rv[p - 1]:
                rv.insert(p, r)
                rb.insert(p, j)
            rb[-1] = nb
            continue
        room[j] = r
        proom[j] -= q
        bins[j].append(i)
        if rb[p] != j:  # not a record (a patch miss placed it): the records stand
            continue
        low = rv[p - 1] if p else -1
        end = rb[p + 1]
        if j + 1 == end:
            if r > low:
                rv[p] = r
            else:
                del rv[p], rb[p]
            continue
        if r > low:
            new_v, new_b, m = [r], [j], r
        else:
            new_v, new_b, m = [], [], low
        if tree is None and end - j > limit:
            size = 1 << nb.bit_length()
            tree = max_tree(room, size, capacity)
        _new_records(room, tree, size, j + 1, end, m, new_v, new_b)
        rv[p : p + 1] = new_v
        rb[p : p + 1] = new_b
    return bins


def _bfd(lens: Sequence[int], pats: Sequence[int] | None, capacity: int, max_p: int) -> Bins:
    """Bins live in one sorted list of keys free tokens·K + bin (K > bins), so
    `bisect_left(keys, s·K)` is the tightest bin, ties to the lowest bin. A bin left with fewer
    free tokens than the shortest item leaves the keys (no item fits it again). A patch miss
    scans on in key order; once a scan would pass `trees.SCAN_LIMIT` bins, `RoomPatches` takes
    the keys' bins over and places that item and every later one (the keys, whose moves shift
    every looser bin, are no longer kept). (The loop without a patch budget is the keys' loop
    with the patch steps left out.)"""
    n = len(lens)
    K = n + 1
    order = sorted(range(n), key=lens.__getitem__, reverse=True)
    least = lens[order[-1]] if n else 0
    keys: list[int] = []
    bins: Bins = []
    if pats is None:
        for i in order:
            s = lens[i]
            p = bisect_left(keys, s * K)
            if p == len(keys):
                r = capacity - s
                if r >= least:
                    insort(keys, r * K + len(bins))
                bins.append([i])
            else:
                r, j = divmod(keys.pop(p), K)
                bins[j].append(i)
                r -= s
                if r >= least:
                    insort(keys, r * K + j, 0, p)
        return bins
    proom: list[int] = []
    items = iter(order)
    for i in items:
        s, q = lens[i], pats[i]
        p = bisect_left(keys, s * K)
        if p < len(keys) and proom[keys[p] % K] < q:  # scan on in key order
            end = min(p + trees.SCAN_LIMIT, len(keys))
            p += 1
            while p < end and proom[keys[p] % K] < q:
                p += 1
            if p == end < len(keys):  # too far: from this item on the tree answers
                break
        if p == len(keys):
            r = capacity - s
            if r >= least:
                insort(keys, r * K + len(bins))
            bins.append([i])
            proom.append(max_p - q)
        else:
            r, j = divmod(keys.pop(p), K)
            bins[j].append(i)
            proom[j] -= q
            r -= s
            if r >= least:
                insort(keys, r * K + j, 0, p)
    else:
        return bins
    index = RoomPatches(capacity, keys, K, proom)
    items = chain((i,), items)  # the item whose scan ran too far, then the rest
    for i in items:
        s, q = lens[i], pats[i]
        hit = index.take(s, q)
        if hit is None:
            r, j = capacity, len(bins)
            bins.append([i])
            proom.append(max_p - q)
        else:
            r, j = hit
            bins[j].append(i)
            proom[j] -= q
        r -= s
        if r >= least:
            index.put(j, r)
    return bins


_RUN: dict[str, Callable[[Sequence[int], Sequence[int] | None, int, int], Bins]] = {
    "greedy": _greedy,
    "ffd": _ffd,
    "bfd": _bfd,
}
