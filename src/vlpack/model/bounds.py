"""Values derived from boundary tensors, computed once per tensor object, not once per layer.

Every attention and Gated-DeltaNet layer of a forward receives the SAME `cu_seqlens` tensor
object (the batch's, or the one the vision tower built), and the deepstack layers the same image
mask. Host copies of them (to validate boundaries, read the longest segment) or index tensors
derived from them need a device sync; deriving them once per layer would stall the GPU queue
~100 times a step. `derived` caches by object identity, checked with a weak reference and the
tensor's version counter, so a freed, reused or modified tensor never returns stale values.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

V = TypeVar("V")
_HOST: dict = {}


def derived(cache: dict, t: torch.Tensor, make: Callable[[], V], key: Hashable = ()) -> V:
    """`make()`, remembered in `cache` for the tensor object `t` (and `key`) while `t` is alive
    and unmodified. Inference tensors (no version counter) and inference mode are not cached:
    a value made there must not reach a later training step."""
    try:
        version = t._version
    except RuntimeError:
        return make()
    if torch.is_inference_mode_enabled():
        return make()
    hit = cache.get((id(t), key))
    if hit is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    value = make()
    for k in [k for k, v in cache.items() if v[0]() is None]:  # entries of freed tensors
        del cache[k]
    cache[(id(t), key)] = (weakref.ref(t), version, value)
    return value


def host_bounds(cu: torch.Tensor) -> tuple[int, ...]:
    """`cu.tolist()` as a tuple, once per tensor object while it is alive and unmodified."""
    return derived(_HOST, cu, lambda: tuple(int(x) for x in cu.tolist()))


def seed_host_bounds(cu: torch.Tensor, values: tuple[int, ...]) -> None:
    """Record `values` as `cu`'s host copy, for a tensor made from host data (no device sync)."""
    derived(_HOST, cu, lambda: values)


def max_segment(bounds: tuple[int, ...]) -> int:
    return max(b - a for a, b in itertools.pairwise(bounds))
