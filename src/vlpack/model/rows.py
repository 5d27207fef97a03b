"""Each token's K routed rows summed in float32: the experts' combine and the row gather's backward.

    out_TD[t] = Σ_k src_PD[index_P[t·K + k]]     (k in order, float32; stored in `out_dtype`)

`index_P` is each routed pair's position in `src_PD` (the dispatch's `inverse_P`), so a token's K
rows are read by position, summed in a fixed order (deterministic, no atomics) and written once.
torch.compile fuses the torch expression (`src[index].view(T, K, D).sum(1)`) into one reduction
kernel; on an H100 at 8,192-token bins it moved its bytes at about a third of the card's memory
bandwidth (docs/benchmarks/profiles.md, `triton_per_fused_index_sum_view`: 318 µs a call).
On CUDA with Triton, `gather_sum` runs `_gather_sum_kernel` instead: one program per token and
block of D, its K indices loaded once, its K row blocks read and summed in registers. It is a
torch library op made with `torch.library.triton_op`, so compiled code calls the same kernel;
elsewhere (CPU, no Triton) the op is the torch expression.

`check_kernel` compares the kernel with the torch expression once per device on random rows (the
shapes of a routed layer, including a width that is not a multiple of the block), before the
first dispatch uses it (model/experts.py): a kernel that disagrees stops the run.

Legend: T = tokens, K = rows per token, P = T·K rows, D = row width.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent (CPU CI)
    triton = None

BLOCK_D = 1024
"""Row elements one program sums (Qwen3.5-35B-A3B's D = 2,048: two programs per token)."""


def reference(src_PD: torch.Tensor, index_P: torch.Tensor, k: int,
              out_dtype: torch.dtype) -> torch.Tensor:
    """The torch expression: gather the rows, view [T, K, D], sum over K in float32.

    The float32 sum is returned itself, not through a no-op `.to(torch.float32)`: an
    autograd.Function forward (model/experts.py) that returns such an alias of its own
    intermediate gets zero gradients under torch.compile in torch 2.11 (tests/model/test_rows.py)."""
    sum_TD = src_PD[index_P].view(-1, k, src_PD.shape[-1]).sum(1, dtype=torch.float32)
    return sum_TD if out_dtype == torch.float32 else sum_TD.to(out_dtype)


def runs_kernel(src_PD: torch.Tensor) -> bool:
    """Whether `gather_sum` runs the Triton kernel for these rows (CUDA, Triton importable)."""
    return triton is not None and src_PD.is_cuda


if triton is not None:
    @triton.jit
    def _gather_sum_kernel(src_ptr, index_ptr, out_ptr, D, K: tl.constexpr,
                           BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = d < D
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(index_ptr + t * K + j).to(tl.int64)
            acc += tl.load(src_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)


@torch.library.triton_op("vlpack::gather_sum", mutates_args=())
def gather_sum(src_PD: torch.Tensor, index_P: torch.Tensor, k: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """`out[t] = Σ_j src_PD[index_P[t·k + j]]` in float32, stored in `out_dtype` [P / k, D]."""
    if not runs_kernel(src_PD):
        return reference(src_PD, index_P, k, out_dtype)
    src_PD, index_P = src_PD.contiguous(), index_P.contiguous()
    T, D = index_P.shape[0] // k, src_PD.shape[-1]
    out_TD = src_PD.new_empty((T, D), dtype=out_dtype)
    grid = (T, triton.cdiv(D, BLOCK_D))
    torch.library.wrap_triton(_gather_sum_kernel)[grid](src_PD, index_P, out_TD, D, K=k,
                                                        BLOCK=BLOCK_D)
    return out_TD


@functools.cache
def check_kernel(device: torch.device, k: int) -> None:
    """Compare the kernel with `reference` on random rows on `device` (once per device and
    k); ValueError where they differ by more than float32 rounding. Nothing to do off CUDA."""
    if not runs_kernel(torch.empty(0, device=device)):
        return
    with torch.cuda.device(device):  # the eager launch goes to the current device
        _check_on(device, k)


def _check_on(device: torch.device, k: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    for T, D in ((97, 2048), (5, 1000)):
        src = torch.randn(T * k, D, device=device, generator=g).to(torch.bfloat16)
        index = torch.randperm(T * k, device=device, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            got, want = gather_sum(src, index, k, dtype), reference(src, index, k, dtype)
            err = float((got.float() - want.float()).abs().max())
            bound = 1e-5 if dtype == torch.float32 else 2 ** -7  # one bf16 rounding step
            if not err <= bound * float(want.float().abs().max()):
                raise ValueError(
                    f"vlpack's Triton row sum (model/rows.py) disagrees with torch on {device} "
                    f"({T}x{k} rows of {D}, {dtype}): max error {err:.3g}. Train with "
                    "model.compile=false and report it; the experts then sum in torch")
