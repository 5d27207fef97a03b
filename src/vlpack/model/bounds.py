"""Host copies of boundary tensors: one device sync per tensor and forward, not per layer.

Every attention and Gated-DeltaNet layer of a forward receives the SAME `cu_seqlens` tensor
object (the batch's, or the one the vision tower built). Validating it and reading its maximum
needs host values; reading them once per layer would stall the GPU queue ~100 times a step.
The cache is keyed by object identity, checked with a weak reference and the tensor's version
counter, so a freed or modified tensor never returns stale values.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_CACHE: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}


def host_bounds(cu: torch.Tensor) -> tuple[int, ...]:
    """`cu.tolist()` as a tuple, cached per tensor object while it is alive and unmodified."""
    try:
        version = cu._version
    except RuntimeError:  # inference tensors have no version counter: do not cache
        return tuple(int(x) for x in cu.tolist())
    hit = _CACHE.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == version:
        return hit[2]
    values = tuple(int(x) for x in cu.tolist())
    if len(_CACHE) > 256:
        for k in [k for k, v in _CACHE.items() if v[0]() is None]:
            del _CACHE[k]
    _CACHE[id(cu)] = (weakref.ref(cu), version, values)
    return values


def max_segment(bounds: tuple[int, ...]) -> int:
    return max(b - a for a, b in itertools.pairwise(bounds))
