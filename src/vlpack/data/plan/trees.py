"""Indexes of the planners (algorithms.py): segment trees built on first need.

With a patch budget, a planner first checks the bin (or item) its token rule picks. When that
one lacks the patches, it scans on in its rule's order over at most `SCAN_LIMIT` items (greedy)
or bins and, when a scan would run past that, builds its tree from its state at that moment and
asks it on every miss from then on (best fit: on every item, its tree then holding the bins). A
tree answers "the first candidate, in the rule's own order, whose patches fit too" in O(log)
steps. Inputs whose patch budget never binds build none. First fit's max-tree over free tokens
(`max_tree`, `first_above`) is built the same way, when repairing its records or a patch miss
would scan past `SCAN_LIMIT` bins.

Node k's children are 2k and 2k+1; the root is node 1; leaves start at `size`.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterable, Sequence

SCAN_LIMIT = 64
"""Items or bins a planner scans before it builds a tree (and asks it from then on)."""

_INF = float("inf")


def _raise_max(tree: list, node: int) -> None:
    """Restores max(children) on the path above leaf `node`; stops where nothing changes."""
    node >>= 1
    while node:
        a, c = tree[2 * node], tree[2 * node + 1]
        m = a if a > c else c
        if tree[node] == m:
            return
        tree[node] = m
        node >>= 1


class ItemPatches:
    """Greedy's index: leaf p holds the patches of the p-th item in a stable ascending sort by
    length (∞: taken), so the item greedy takes among those of ≤ room tokens is the rightmost
    leaf before `bisect_right(lengths, room)` with ≤ budget patches. Built from the items left
    (`left`: greedy's stacks); the planner reports every item it takes with `take`."""

    __slots__ = ("lengths", "order", "pos", "size", "tree")

    def __init__(self, lens: Sequence[int], pats: Sequence[int], left: Iterable[list[int]]) -> None:
        n = len(lens)
        self.order = order = sorted(range(n), key=lens.__getitem__)
        self.lengths = list(map(lens.__getitem__, order))
        self.pos = pos = [0] * n
        """pos[i]: item i's leaf."""
        for p, i in enumerate(order):
            pos[i] = p
        self.size = size = 1 << max(n - 1, 0).bit_length()
        self.tree = tree = [_INF] * (2 * size)
        for st in left:
            for i in st:
                tree[size + pos[i]] = pats[i]
        for node in range(size - 1, 0, -1):
            a, c = tree[2 * node], tree[2 * node + 1]
            tree[node] = a if a < c else c

    def take(self, i: int) -> None:
        """Item i leaves: its leaf becomes ∞, and the minima above it follow."""
        tree = self.tree
        node = self.size + self.pos[i]
        tree[node] = _INF
        node >>= 1
        while node:
            a, c = tree[2 * node], tree[2 * node + 1]
            m = a if a < c else c
            if tree[node] == m:
                break
            tree[node] = m
            node >>= 1

    def rightmost(self, room: int, budget: int) -> int:
        """The item greedy takes: the last one, in the sort, of ≤ room tokens and ≤ budget
        patches, else -1."""
        end = bisect_right(self.lengths, room)
        if not end:
            return -1
        tree, size = self.tree, self.size
        node = end - 1 + size
        while tree[node] > budget:  # on to the next subtree to the left
            while not node & 1:
                node >>= 1
            if node == 1:
                return -1
            node -= 1
        while node < size:
            node = 2 * node + 1 if tree[2 * node + 1] <= budget else 2 * node
        return self.order[node - size]


class BinPatches:
    """First fit's index: leaf j holds bin j's free patches (unopened bins: the full budget);
    `first_fit` searches it together with the planner's free-token tree over the same bins.
    The planner adds every bin it changes to `dirty`; a search first updates those leaves."""

    __slots__ = ("dirty", "proom", "size", "tree")

    def __init__(self, size: int, proom: list[int], max_patches: int) -> None:
        self.size, self.proom = size, proom
        tree = [max_patches] * (2 * size)
        tree[size : size + len(proom)] = proom
        for node in range(size - 1, 0, -1):
            a, c = tree[2 * node], tree[2 * node + 1]
            tree[node] = a if a > c else c
        self.tree = tree
        self.dirty: list[int] = []
        """Bins whose free patches changed since the last search."""

    def first_fit(self, tokens: list[int], start: int, s: int, q: int) -> int:
        """Lowest bin ≥ start with ≥ s free tokens (max-tree `tokens`) and ≥ q free patches.
        An unopened bin fits both, so the search always ends."""
        tp, size, proom = self.tree, self.size, self.proom
        for j in self.dirty:
            tp[size + j] = proom[j]
            _raise_max(tp, size + j)
        self.dirty.clear()
        node = start + size
        while True:
            while tokens[node] < s or tp[node] < q:  # on to the next subtree to the right
                while node & 1:
                    node >>= 1
                node += 1
            while node < size:
                node <<= 1
                if tokens[node] < s or tp[node] < q:
                    node += 1
            if tokens[node] >= s and tp[node] >= q:  # both maxima may come from different bins
                return node - size


class RoomPatches:
    """Best fit's index: leaf r holds the most free patches among the bins with exactly r free
    tokens (-1: no such bin) and `at[r]` those bins in ascending order. Built from the planner's
    sorted keys (free tokens·K + bin); from then on it alone holds the bins an item may still
    fit: `take` removes the one an item goes to, `put` adds a bin back (or a new one) with its
    new free tokens."""

    __slots__ = ("at", "proom", "size", "tree")

    def __init__(self, capacity: int, keys: list[int], K: int, proom: list[int]) -> None:
        # leaves 0..capacity-1: a bin holds ≥ 1 token, and a search starts at a bin's leaf
        self.size = size = 1 << max(capacity - 1, 0).bit_length()
        self.proom = proom
        self.at: dict[int, list[int]] = {}
        tree = [-1] * (2 * size)
        for key in keys:  # ascending, so each at[r] is too
            r, j = divmod(key, K)
            self.at.setdefault(r, []).append(j)
            if proom[j] > tree[size + r]:
                tree[size + r] = proom[j]
        for node in range(size - 1, 0, -1):
            a, c = tree[2 * node], tree[2 * node + 1]
            tree[node] = a if a > c else c
        tree[0] = _INF  # above the root: stops every raise in `put`
        self.tree = tree

    def put(self, j: int, r: int) -> None:
        """Bin j now has r free tokens and proom[j] free patches."""
        at = self.at.get(r)
        if at is None:
            self.at[r] = [j]
        else:
            insort(at, j)
        tree, p = self.tree, self.proom[j]
        node = self.size + r
        if p > tree[node]:
            tree[node] = p
            node >>= 1
            while tree[node] < p:  # parents hold the max of their children
                tree[node] = p
                node >>= 1

    def take(self, s: int, q: int) -> tuple[int, int] | None:
        """Removes the bin with the fewest free tokens ≥ s whose free patches are ≥ q (ties:
        lowest bin) and returns (its free tokens, its number); None when no bin has both."""
        tree, size, proom = self.tree, self.size, self.proom
        node = s + size
        while tree[node] < q:  # on to the next subtree to the right
            while node & 1:
                node >>= 1
            if not node:
                return None
            node += 1
        while node < size:
            node = 2 * node if tree[2 * node] >= q else 2 * node + 1
        r = node - size
        at = self.at[r]
        k = 0
        while proom[at[k]] < q:
            k += 1
        j = at.pop(k)
        if proom[j] == tree[node]:  # it may have held the leaf's maximum
            m = max(map(proom.__getitem__, at)) if at else -1
            if m != tree[node]:
                tree[node] = m
                _raise_max(tree, node)
        return r, j


def max_tree(leaves: list[int], size: int, fill: int) -> list[int]:
    """A max-tree over `size` leaves: `leaves` first, then `fill`."""
    tree = [fill] * (2 * size)
    tree[size : size + len(leaves)] = leaves
    for node in range(size - 1, 0, -1):
        a, c = tree[2 * node], tree[2 * node + 1]
        tree[node] = a if a > c else c
    return tree


def first_above(tree: list[int], size: int, start: int, m: int) -> int:
    """The lowest leaf ≥ start of max-tree `tree` that holds more than m. One must exist (first
    fit keeps an unopened, full bin to the right of every search)."""
    node = start + size
    while tree[node] <= m:  # on to the next subtree to the right
        while node & 1:
            node >>= 1
        node += 1
    while node < size:
        node <<= 1
        if tree[node] <= m:
            node += 1
    return node - size
