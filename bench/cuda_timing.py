"""One forward and backward on CUDA, timed apart with CUDA events: the kernel benches' step
(bench/experts_dispatch.py, bench/gdn_kernels.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def fwd_bwd_step(forward: Callable[[], torch.Tensor], grad: torch.Tensor,
                 leaves: Iterable[torch.Tensor], times: list | None = None) -> None:
    """Run `forward()` and its backward from `grad`; with `times`, append (forward ms, backward
    ms) after waiting for the GPU. The gradients of `leaves` are cleared after each step."""
    a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    a.record()
    out = forward()
    b.record()
    out.backward(grad)
    c.record()
    if times is not None:
        torch.cuda.synchronize()
        times.append((a.elapsed_time(b), b.elapsed_time(c)))
    for t in leaves:
        t.grad = None
