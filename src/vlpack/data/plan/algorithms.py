"""Bin planning: pure functions from sample lengths to bins of sample indices.

Lengths in, groups out; no tensors (see `plan_online.py` for the bounded-buffer planner). Every
item lands in exactly one bin; a bin's token sum is ≤ `capacity` and, when `max_patches` is
given, its ViT-patch sum is ≤ `max_patches`. An item that cannot fit an empty bin raises
`ValueError`: apply the overlong policy (truncate or drop) before planning, never here.

Algorithms (all deterministic; items of equal length keep a fixed, index-based order):

- `greedy_knapsack` — Megatron-Bridge/Energon's packing recipe: sort ascending; fill one bin at
  a time, repeatedly taking the largest remaining item that still fits (binary search).
- `first_fit_decreasing` — items longest first, each into the lowest-numbered bin it fits,
  else a new bin; a prefix-maximum "record" list (short inputs) or a segment tree finds it.
- `best_fit_decreasing` — items longest first, each into the bin it fits with the least room
  left (ties: lowest bin number), else a new bin; bins kept in one sorted list of int keys.

With a patch budget "fits" means both budgets. Short inputs (≤ 4,096 items: a buffer) take
list-based paths, long ones tree-based paths with no quadratic cases; both give the same bins.

Within a bin, items appear in the order they were placed. Output bins appear in the order they
were opened, unless `seed` is given: then the list of bins is shuffled with `random.Random(seed)`
so that a stream of bins does not run from the longest items to the shortest. Bins themselves
are identical with or without a seed.

`plan_lists` is the core both `plan_bins` and `OnlinePlanner` (online.py) run. The product
plans buffers of `data.buffer_size` items (256 by default) with the list-based paths; a buffer of
more than 4,096 items takes the tree-based paths.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Sequence
from typing import Literal

__all__ = [
    "ALGORITHMS",
    "Algo",
    "best_fit_decreasing",
    "check_algo",
    "first_fit_decreasing",
    "greedy_knapsack",
    "plan_bins",
    "plan_lists",
]

Algo = Literal["greedy", "ffd", "bfd"]
Bins = list[list[int]]

_INF = float("inf")


# --------------------------------------------------------------------------- validation


def _as_int_list(values: Sequence[int], name: str) -> list[int]:
    """A plain list of Python ints (fast path for numpy arrays via `.tolist()`)."""
    tolist = getattr(values, "tolist", None)
    out = tolist() if callable(tolist) else list(values)
    if out and not all(type(v) is int for v in out):
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


def _shuffled(bins: Bins, seed: int | None) -> Bins:
    if seed is not None:
        random.Random(seed).shuffle(bins)
    return bins


# --------------------------------------------------------------------------- greedy knapsack


_GREEDY_LIST_MAX_ITEMS = 4096
"""Up to this many items greedy keeps one sorted list and pops from it (fastest for buffers);
above, list pops cost O(n) each and per-length stacks (or, with patches, a tree) take over."""


def _greedy_small(
    lens: Sequence[int], capacity: int, pats: Sequence[int] | None = None, max_p: int = 0
) -> Bins:
    """Greedy knapsack, short inputs: a stably sorted list; each pick is the rightmost bisect
    hit (equal lengths go highest index first), popped. With a patch budget the pick walks left
    to the first item whose patches fit (worst case O(n) per pick; fine for a buffer)."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    slens = [lens[i] for i in order]
    spats = None if pats is None else [pats[i] for i in order]
    bins: Bins = []
    while slens:
        room, proom = capacity, max_p
        b: list[int] = []
        while True:
            k = bisect_right(slens, room) - 1
            if spats is not None:
                while k >= 0 and spats[k] > proom:
                    k -= 1
                if k >= 0:
                    proom -= spats.pop(k)
            if k < 0:
                break
            room -= slens.pop(k)
            b.append(order.pop(k))
        bins.append(b)
    return bins


def _greedy_tokens(lens: Sequence[int], capacity: int) -> Bins:
    """Greedy knapsack, one budget, long inputs. Items of one length form a stack (highest
    index on top, as a stable ascending sort plus a rightmost bisect would pick); `vals` holds
    the lengths still present, so each pick is one bisect over ≤ capacity distinct values."""
    stacks: dict[int, list[int]] = {}
    for i, v in enumerate(lens):
        st = stacks.get(v)
        if st is None:
            stacks[v] = [i]
        else:
            st.append(i)
    vals = sorted(stacks)
    bins: Bins = []
    while vals:
        room = capacity
        b: list[int] = []
        while True:
            k = bisect_right(vals, room)
            if not k:
                break
            v = vals[k - 1]
            st = stacks[v]
            b.append(st.pop())
            room -= v
            if not st:
                del vals[k - 1]
        bins.append(b)
    return bins


def _greedy_two_budgets(lens: list[int], pats: list[int], capacity: int, max_p: int) -> Bins:
    """Greedy knapsack, tokens and patches, long inputs. Items sorted by (length, index); a
    min-segment tree over their patch counts (taken items = ∞) finds, among the items whose
    tokens fit, the rightmost one whose patches fit too."""
    n = len(lens)
    order = sorted(range(n), key=lens.__getitem__)
    slens = [lens[i] for i in order]
    size = 1 << max(n - 1, 0).bit_length()
    tree: list[float] = [_INF] * (2 * size)
    tree[size : size + n] = [pats[i] for i in order]
    for node in range(size - 1, 0, -1):
        tree[node] = min(tree[2 * node], tree[2 * node + 1])

    def rightmost(end: int, budget: int) -> int:
        """Rightmost position < end whose patch count ≤ budget, else -1."""
        if end <= 0:
            return -1
        node = end - 1 + size
        while tree[node] > budget:
            while not node & 1:
                node >>= 1
            if node == 1:
                return -1
            node -= 1
        while node < size:
            node = 2 * node + 1 if tree[2 * node + 1] <= budget else 2 * node
        return node - size

    bins: Bins = []
    left = n
    while left:
        room, proom = capacity, max_p
        b: list[int] = []
        while True:
            pos = rightmost(bisect_right(slens, room), proom)
            if pos < 0:
                break
            i = order[pos]
            b.append(i)
            room -= lens[i]
            proom -= pats[i]
            node = pos + size
            tree[node] = _INF
            node >>= 1
            while node:
                a, c = tree[2 * node], tree[2 * node + 1]
                m = a if a < c else c
                if tree[node] == m:
                    break
                tree[node] = m
                node >>= 1
        assert b, "an empty bin must accept the largest remaining item"
        left -= len(b)
        bins.append(b)
    return bins


def greedy_knapsack(
    lengths: Sequence[int],
    capacity: int,
    *,
    patches: Sequence[int] | None = None,
    max_patches: int | None = None,
    seed: int | None = None,
) -> Bins:
    """Energon/Megatron-Bridge greedy knapsack: fill bins one at a time, each time taking the
    largest remaining item that still fits. Returns bins of item indices."""
    lens, pats = _validate(lengths, capacity, patches, max_patches)
    return _shuffled(plan_lists("greedy", lens, pats, capacity, max_patches), seed)


# --------------------------------------------------------------------------- first fit


_FFD_RECORDS_MAX_ITEMS = 4096
"""Above this many items FFD uses segment trees: the record scan (and, with patches, the bin
scan) can degrade on long inputs (many nearly full bins in one gap); below, records are
faster."""


def _ffd_records(
    lens: Sequence[int], capacity: int, pats: Sequence[int] | None = None, max_p: int = 0
) -> Bins:
    """First-fit decreasing for short inputs.

    `room[j]` is bin j's free space. The first bin that fits s is the first prefix maximum
    ("record") of `room` that is ≥ s; records are increasing in both bin number (`rb`) and
    room (`rv`), so one bisect finds it. A sentinel record (room capacity + 1, bin = the next
    bin to open) ends the list. After a bin shrinks, only the records between it and the next
    record can change; a scan of that gap rebuilds them. With a patch budget, when the found
    bin lacks patch room the bins after it are scanned in order.
    """
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    room: list[int] = []
    proom: list[int] = []
    bins: Bins = []
    rv: list[int] = [capacity + 1]
    rb: list[int] = [0]
    nb = 0
    for i in order:
        s = lens[i]
        p = bisect_left(rv, s)
        j = rb[p]
        if pats is not None:
            q = pats[i]
            if j != nb and proom[j] < q:
                j = next((k for k in range(j + 1, nb) if room[k] >= s and proom[k] >= q), nb)
                p = bisect_left(rb, j)
                if rb[p] != j:  # a bin that is not a record: no record changes
                    room[j] -= s
                    proom[j] -= q
                    bins[j].append(i)
                    continue
            if j == nb:
                proom.append(max_p - q)
            else:
                proom[j] -= q
        if j == nb:  # the sentinel: open a bin
            r = capacity - s
            room.append(r)
            bins.append([i])
            nb += 1
            if not p or r > rv[p - 1]:
                rv.insert(p, r)
                rb.insert(p, j)
            rb[-1] = nb
            continue
        r = rv[p] - s
        room[j] = r
        bins[j].append(i)
        low = rv[p - 1] if p else -1
        end = rb[p + 1]
        if j + 1 == end:
            if r > low:
                rv[p] = r
            else:
                del rv[p], rb[p]
            continue
        new_v: list[int] = []
        new_b: list[int] = []
        m = low
        if r > m:
            new_v.append(r)
            new_b.append(j)
            m = r
        for k in range(j + 1, end):
            x = room[k]
            if x > m:
                new_v.append(x)
                new_b.append(k)
                m = x
        rv[p : p + 1] = new_v
        rb[p : p + 1] = new_b
    return bins


def _ffd_tree(lens: list[int], capacity: int) -> Bins:
    """First-fit decreasing, one budget, for long inputs: a max-segment tree over bins (free
    tokens; unopened bins are full) and a leftmost descent. O(n log n) with no bad cases."""
    n = len(lens)
    order = sorted(range(n), key=lens.__getitem__, reverse=True)
    size = 1 << max(n - 1, 0).bit_length()
    tree = [capacity] * (2 * size)
    bins: Bins = []
    for i in order:
        s = lens[i]
        node = 1
        while node < size:
            node <<= 1
            if tree[node] < s:
                node += 1
        j = node - size
        if j == len(bins):
            bins.append([i])
        else:
            bins[j].append(i)
        tree[node] -= s
        node >>= 1
        while node:
            a = tree[2 * node]
            b = tree[2 * node + 1]
            m = a if a > b else b
            if tree[node] == m:
                break
            tree[node] = m
            node >>= 1
    return bins


def _ffd_two_budgets(lens: list[int], pats: list[int], capacity: int, max_p: int) -> Bins:
    """First-fit decreasing, tokens and patches: a segment tree over bins holding the max
    free tokens and max free patches of each subtree; a pruned depth-first search finds the
    leftmost bin that fits both. Unopened bins are leaves with full room, so "no open bin
    fits" naturally opens the next one."""
    n = len(lens)
    order = sorted(range(n), key=lens.__getitem__, reverse=True)
    size = 1 << max(n - 1, 0).bit_length()
    tt = [capacity] * (2 * size)
    tp = [max_p] * (2 * size)
    bins: Bins = []
    for i in order:
        s, q = lens[i], pats[i]
        stack = [1]
        node = 0
        while stack:
            node = stack.pop()
            if tt[node] < s or tp[node] < q:
                continue
            if node >= size:
                break
            stack.append(2 * node + 1)
            stack.append(2 * node)
        j = node - size
        assert 0 <= j <= len(bins), "an unopened bin always fits a validated item"
        if j == len(bins):
            bins.append([])
        bins[j].append(i)
        tt[node] -= s
        tp[node] -= q
        node >>= 1
        while node:
            a, b = 2 * node, 2 * node + 1
            tt[node] = tt[a] if tt[a] > tt[b] else tt[b]
            tp[node] = tp[a] if tp[a] > tp[b] else tp[b]
            node >>= 1
    return bins


def first_fit_decreasing(
    lengths: Sequence[int],
    capacity: int,
    *,
    patches: Sequence[int] | None = None,
    max_patches: int | None = None,
    seed: int | None = None,
) -> Bins:
    """First-fit decreasing: longest item first (ties: lower index first), each into the
    lowest-numbered open bin that fits, else a new bin. Returns bins of item indices."""
    lens, pats = _validate(lengths, capacity, patches, max_patches)
    return _shuffled(plan_lists("ffd", lens, pats, capacity, max_patches), seed)


# --------------------------------------------------------------------------- best fit

_BFD_KEYS_MAX_ITEMS = 4096
"""With a patch budget and more items than this, BFD uses the room-indexed tree: the key
list's upward scan for patch room is O(bins) per item in the worst case."""



def _bfd_keys(
    lens: Sequence[int], capacity: int, pats: Sequence[int] | None = None, max_p: int = 0
) -> Bins:
    """Best-fit decreasing. Open bins live in one sorted list of keys room·K + bin (K > bins),
    so `bisect_left(keys, s·K)` is the tightest bin, ties to the lowest bin. With a patch
    budget the scan walks up from there to the first bin whose patches fit (worst case O(bins)
    per item: used for short inputs only)."""
    n = len(lens)
    K = n + 1
    order = sorted(range(n), key=lens.__getitem__, reverse=True)
    keys: list[int] = []
    bins: Bins = []
    proom: list[int] = []
    for i in order:
        s = lens[i]
        p = bisect_left(keys, s * K)
        if pats is not None:
            q = pats[i]
            while p < len(keys) and proom[keys[p] % K] < q:
                p += 1
            if p == len(keys):
                proom.append(max_p - q)
            else:
                proom[keys[p] % K] -= q
        if p == len(keys):
            insort(keys, (capacity - s) * K + len(bins))
            bins.append([i])
        else:
            r, j = divmod(keys.pop(p), K)
            bins[j].append(i)
            insort(keys, (r - s) * K + j)
    return bins


def _bfd_two_budgets(lens: list[int], pats: list[int], capacity: int, max_p: int) -> Bins:
    """Best-fit decreasing, tokens and patches, long inputs. Leaf r of a max-segment tree over
    token room (0..capacity) holds the largest patch room among bins with exactly r free tokens
    (-1: none); "leftmost r ≥ s with value ≥ q" is the tightest bin that fits both budgets, and
    the lowest-numbered bin of that leaf with enough patch room wins the tie."""
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    size = 1 << (capacity + 1).bit_length()
    tree = [-1] * (2 * size)
    at: dict[int, list[int]] = {}  # token room → its bins, ascending
    proom: list[int] = []
    bins: Bins = []

    def set_leaf(r: int, value: int) -> None:
        node = r + size
        tree[node] = value
        node >>= 1
        while node:
            a, b = tree[2 * node], tree[2 * node + 1]
            m = a if a > b else b
            if tree[node] == m:
                break
            tree[node] = m
            node >>= 1

    def tightest(s: int, q: int) -> int:
        node = s + size
        while tree[node] < q:
            while node & 1:
                node >>= 1
            if not node:
                return -1
            node += 1
        while node < size:
            node = 2 * node if tree[2 * node] >= q else 2 * node + 1
        return node - size

    for i in order:
        s, q = lens[i], pats[i]
        r = tightest(s, q)
        if r < 0:
            j = len(bins)
            bins.append([i])
            proom.append(max_p - q)
            r = capacity
        else:
            members = at[r]
            j = next(b for b in members if proom[b] >= q)
            members.remove(j)
            if proom[j] == tree[r + size]:  # it may have held the leaf's maximum
                set_leaf(r, max(map(proom.__getitem__, members)) if members else -1)
            bins[j].append(i)
            proom[j] -= q
        members = at.setdefault(r - s, [])
        insort(members, j)
        if proom[j] > tree[r - s + size]:
            set_leaf(r - s, proom[j])
    return bins


def best_fit_decreasing(
    lengths: Sequence[int],
    capacity: int,
    *,
    patches: Sequence[int] | None = None,
    max_patches: int | None = None,
    seed: int | None = None,
) -> Bins:
    """Best-fit decreasing: longest item first (ties: lower index first), each into the open
    bin with the least token room that still fits it (ties: lowest bin number), else a new
    bin. Returns bins of item indices."""
    lens, pats = _validate(lengths, capacity, patches, max_patches)
    return _shuffled(plan_lists("bfd", lens, pats, capacity, max_patches), seed)


# --------------------------------------------------------------------------- dispatcher


def plan_lists(
    algo: str,
    lens: Sequence[int],
    pats: Sequence[int] | None,
    capacity: int,
    max_patches: int | None,
) -> Bins:
    """Runs `algo` on validated int sequences (no checks, no shuffle): the shared core of the
    offline functions and `OnlinePlanner`. Short inputs (a buffer) take the list-based paths,
    long ones the tree-based paths; both give identical bins."""
    if max_patches is None:
        pats = None
    n, mp = len(lens), max_patches or 0
    if algo == "greedy":
        if n <= _GREEDY_LIST_MAX_ITEMS:
            return _greedy_small(lens, capacity, pats, mp)
        if pats is None:
            return _greedy_tokens(lens, capacity)
        return _greedy_two_budgets(lens, pats, capacity, mp)
    if algo == "ffd":
        if n <= _FFD_RECORDS_MAX_ITEMS:
            return _ffd_records(lens, capacity, pats, mp)
        if pats is None:
            return _ffd_tree(lens, capacity)
        return _ffd_two_budgets(lens, pats, capacity, mp)
    if n <= _BFD_KEYS_MAX_ITEMS or pats is None:
        return _bfd_keys(lens, capacity, pats, mp)
    return _bfd_two_budgets(lens, pats, capacity, mp)


ALGORITHMS: dict[str, Callable[..., Bins]] = {
    "greedy": greedy_knapsack,
    "ffd": first_fit_decreasing,
    "bfd": best_fit_decreasing,
}
"""Planner name → offline function."""


def check_algo(algo: str) -> None:
    """Raises ValueError naming the choices when `algo` is not a known planner."""
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown packing algo {algo!r}; choose one of {sorted(ALGORITHMS)}")


def plan_bins(
    lengths: Sequence[int],
    capacity: int,
    algo: Algo = "ffd",
    *,
    patches: Sequence[int] | None = None,
    max_patches: int | None = None,
    seed: int | None = None,
) -> Bins:
    """Plans `lengths` into bins with the named algorithm ("greedy", "ffd" or "bfd").

    `patches` only count when `max_patches` is given. `seed` shuffles the order of the bins
    (not their contents); None keeps the order in which bins were opened.
    """
    check_algo(algo)
    return ALGORITHMS[algo](
        lengths, capacity, patches=patches, max_patches=max_patches, seed=seed
    )
