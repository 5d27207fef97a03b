"""Online bin planning over a bounded buffer, with carry-over of underfilled bins.

Packing each buffer on its own leaves the last bins of every buffer underfilled (the leftovers
of that buffer). `OnlinePlanner` plans the buffer when it is full, emits the bins that are well
filled and keeps the items of the others in the buffer, where they meet the next items.

Bounds (host memory and latency): the buffer never holds more than `buffer_size` items; after a
round at most `max_carry` items stay (the fullest underfilled bins are emitted until that
holds, so every round frees ≥ buffer_size - max_carry slots); and a bin holding an item that has
already waited `max_wait_rounds` rounds is emitted whatever its fill.

Deterministic: the same stream of pushes gives the same bins in the same order. Within a round
ready bins are shuffled with a generator seeded by (seed, round). `state_dict()` is plain JSON;
a planner restored from it continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Sequence
from itertools import repeat

from vlpack.data.plan.algorithms import Algo, _plan_checked, check_algo

__all__ = ["OnlinePlanner"]

Bins = list[list[int]]

_CONFIG_KEYS = (
    "capacity",
    "algo",
    "buffer_size",
    "max_patches",
    "seed",
    "min_fill",
    "max_carry",
    "max_wait_rounds",
)


class OnlinePlanner:
    """Streams (item_id, tokens, patches) in, bins of item_ids out.

    Args:
      capacity: tokens per bin.
      algo: "greedy", "ffd" or "bfd" (see `vlpack.data.plan.algorithms`; the default is
        `DataConfig.packing`).
      buffer_size: items planned together; a round runs when the buffer is full.
      max_patches: ViT patches per bin (None: no patch budget).
      seed: seeds the per-round shuffle of the emitted bins.
      min_fill: a bin is ready when tokens ≥ min_fill·capacity (or patches ≥
        min_fill·max_patches); others are carried to the next round.
      max_carry: most items kept after a round (default buffer_size // 2).
      max_wait_rounds: an item carried this many rounds is emitted in its bin regardless.
    """

    __slots__ = (*_CONFIG_KEYS, "_buf", "_round")

    def __init__(
        self,
        capacity: int,
        algo: Algo,
        buffer_size: int,
        *,
        max_patches: int | None = None,
        seed: int = 0,
        min_fill: float = 0.98,
        max_carry: int | None = None,
        max_wait_rounds: int = 8,
    ) -> None:
        check_algo(algo)
        if capacity < 1:
            raise ValueError(f"capacity must be ≥ 1 token; got {capacity}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be ≥ 1; got {buffer_size}")
        if not 0.0 <= min_fill <= 1.0:
            raise ValueError(f"min_fill is a fraction of the capacity in [0, 1]; got {min_fill}")
        if max_carry is None:
            max_carry = buffer_size // 2
        if not 0 <= max_carry < buffer_size:
            raise ValueError(
                f"max_carry must be in [0, buffer_size) = [0, {buffer_size}) so that every "
                f"round frees buffer slots; got {max_carry}"
            )
        if max_wait_rounds < 1:
            raise ValueError(f"max_wait_rounds must be ≥ 1; got {max_wait_rounds}")
        if max_patches is not None and max_patches < 0:
            raise ValueError(f"max_patches must be ≥ 0 or None; got {max_patches}")
        self.capacity = capacity
        self.algo = algo
        self.buffer_size = buffer_size
        self.max_patches = max_patches
        self.seed = seed
        self.min_fill = min_fill
        self.max_carry = max_carry
        self.max_wait_rounds = max_wait_rounds
        self._round = 0
        self._buf: list[tuple[int, int, int, int]] = []  # (item_id, tokens, patches, born)

    def __len__(self) -> int:
        """Items waiting in the buffer."""
        return len(self._buf)

    def push(self, item_id: int, tokens: int, patches: int = 0) -> Bins:
        """Adds one item; returns the bins (lists of item_ids) that became ready, often []."""
        if tokens > self.capacity or tokens < 1 or (patches and self.max_patches is not None):
            self._check(item_id, tokens, patches)
        buf = self._buf
        buf.append((item_id, tokens, patches, self._round))
        if len(buf) < self.buffer_size:
            return []
        return self._plan(final=False)

    def _check(self, item_id: int, tokens: int, patches: int) -> None:
        if not 1 <= tokens <= self.capacity:
            raise ValueError(
                f"item {item_id} has {tokens} tokens, outside [1, capacity={self.capacity}]; "
                "apply the overlong policy (truncate or drop) before planning"
            )
        if self.max_patches is not None and not 0 <= patches <= self.max_patches:
            raise ValueError(
                f"item {item_id} has {patches} ViT patches, outside [0, max_patches="
                f"{self.max_patches}]; downscale its images or drop it before planning"
            )

    def extend(
        self, item_ids: Sequence[int], tokens: Sequence[int], patches: Sequence[int] | None = None
    ) -> Bins:
        """Pushes many items (the same bins as `push` one by one); returns every bin that became
        ready, in order. All items are checked first: on an error nothing is pushed."""
        ids, tok = list(item_ids), list(tokens)
        pat = [0] * len(ids) if patches is None else list(patches)
        if not len(ids) == len(tok) == len(pat):
            raise ValueError(
                f"item_ids, tokens and patches differ in length: {len(ids)}, {len(tok)}, "
                f"{len(pat)}"
            )
        if tok and (min(tok) < 1 or max(tok) > self.capacity):
            k = next(k for k, t in enumerate(tok) if not 1 <= t <= self.capacity)
            self._check(ids[k], tok[k], 0)
        if self.max_patches is not None and pat and (min(pat) < 0 or max(pat) > self.max_patches):
            k = next(k for k, p in enumerate(pat) if not 0 <= p <= self.max_patches)
            self._check(ids[k], 1, pat[k])
        out: Bins = []
        start = 0
        while start < len(ids):
            stop = start + self.buffer_size - len(self._buf)
            self._buf += zip(
                ids[start:stop], tok[start:stop], pat[start:stop], repeat(self._round)
            )
            start = stop
            if len(self._buf) >= self.buffer_size:
                out += self._plan(final=False)
        return out

    def flush(self) -> Bins:
        """End of stream: plans what is left and returns every remaining bin."""
        return self._plan(final=True) if self._buf else []

    # ------------------------------------------------------------------ one round

    def _plan(self, *, final: bool) -> Bins:
        buf = self._buf
        ids, tok, pat, born = (list(c) for c in zip(*buf, strict=True))
        bins = _plan_checked(self.algo, tok, pat, self.capacity, self.max_patches)
        if final:
            ready, carried = bins, []
        else:
            ready, carried = self._split(bins, tok, pat, born)
        # Shuffle by sorting on random keys: one C call per bin instead of random.shuffle's
        # Python-level draws; deterministic for (seed, round).
        rnd = random.Random(self.seed * 1_000_003 + self._round).random
        keys = [rnd() for _ in ready]
        order = sorted(range(len(ready)), key=keys.__getitem__)
        self._buf = [buf[i] for i in sorted(i for b in carried for i in b)]
        self._round += 1
        get = ids.__getitem__
        return [list(map(get, ready[j])) for j in order]

    def _split(
        self, bins: Bins, tok: list[int], pat: list[int], born: list[int]
    ) -> tuple[Bins, Bins]:
        """Ready bins (well filled, or holding an item that waited too long) and carried ones;
        promotes the fullest carried bins while more than max_carry items would stay."""
        tok_get = tok.__getitem__
        need_t = self.min_fill * self.capacity
        need_p = self.min_fill * self.max_patches if self.max_patches else None
        # The buffer is in arrival order, so `born` is sorted: positions < n_old waited too long.
        n_old = bisect_right(born, self._round - self.max_wait_rounds)
        ready: Bins = []
        weak: list[tuple[int, int, list[int]]] = []
        for j, b in enumerate(bins):
            load = sum(map(tok_get, b))
            if load >= need_t or (n_old and min(b) < n_old):
                ready.append(b)
            elif need_p is not None and sum(pat[i] for i in b) >= need_p:
                ready.append(b)
            else:
                weak.append((-load, j, b))
        carried = sum(len(b) for _, _, b in weak)
        if carried > self.max_carry:
            weak.sort()
            while carried > self.max_carry:
                _, _, b = weak.pop(0)
                ready.append(b)
                carried -= len(b)
        return ready, [b for _, _, b in weak]

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict:
        """Plain-JSON state: settings, round counter and the buffered items as
        [item_id, tokens, patches, round pushed]."""
        return {
            "version": 1,
            **{k: getattr(self, k) for k in _CONFIG_KEYS},
            "round": self._round,
            "items": [list(x) for x in self._buf],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a `state_dict()`; the planner must have been built with the same settings."""
        if state.get("version") != 1:
            raise ValueError(f"unknown OnlinePlanner state version {state.get('version')!r}")
        for k in _CONFIG_KEYS:
            if state[k] != getattr(self, k):
                raise ValueError(
                    f"state was saved with {k}={state[k]!r} but this planner has "
                    f"{k}={getattr(self, k)!r}; build the planner with the saved settings"
                )
        self._round = int(state["round"])
        self._buf = [(int(i), int(t), int(p), int(r)) for i, t, p, r in state["items"]]
