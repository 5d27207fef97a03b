"""The experts' row-sum kernel on CUDA (model/rows.py), skipped without CUDA or Triton: against the
torch expression alone, under torch.compile at two sizes, and inside the compiled experts'
dispatch, forward and backward."""

from __future__ import annotations

import pytest
import torch

from vlpack.model import experts, rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or rows.triton is None,
                       reason="needs a CUDA device and Triton"),
]


def _step(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 2 ** -7  # float32 order, one bf16 rounding


@pytest.mark.parametrize("compiled", [False, True])
def test_row_sum_kernel_equals_the_torch_expression(compiled):
    rows.check_kernel(torch.device("cuda"), 8)  # raises where the kernel disagrees
    fn = torch.compile(rows.gather_sum, dynamic=True) if compiled else rows.gather_sum
    g = torch.Generator(device="cuda").manual_seed(0)
    for T, K, D in ((4096, 8, 2048), (1000, 8, 2048), (7, 2, 1000)):
        src = torch.randn(T * K, D, device="cuda", generator=g).to(torch.bfloat16)
        index = torch.randperm(T * K, device="cuda", generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            got, want = fn(src, index, K, dtype), rows.reference(src, index, K, dtype)
            assert got.dtype == dtype and got.shape == (T, D)
            err = (got.float() - want.float()).abs().max()
            assert err <= _step(dtype) * want.float().abs().max(), (T, K, D, dtype, float(err))


def test_compiled_dispatch_with_the_kernel_equals_it_with_the_torch_sum():
    """The compiled dispatch as shipped (the kernel for the combine and for the row gather's
    backward) against the same dispatch compiled with the torch expression: output and the
    gradients of the hidden states and routing weights, bf16 experts as the recipe holds them."""
    from vlpack.model.experts import _dispatch, _silu_gate

    g = torch.Generator(device="cuda").manual_seed(0)
    T, E, D, I, K = 3000, 16, 256, 64, 8  # noqa: E741 (experts.py's legend)
    gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    down = (torch.randn(E, D, I, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(T, D, device="cuda", generator=g)
    w, idx = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K)
    shipped = experts._compiled_silu_dispatch()
    with_torch = torch.compile(
        lambda *a: _dispatch(*a[:5], _silu_gate, *a[5:], row_sum=rows.reference), dynamic=True)

    def run(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        for t in (idx, wi):
            torch._dynamo.mark_static(t, 1)
        out = fn(xi, idx, wi, gate_up, down, torch.bfloat16, None, None, None, None)
        out.pow(2).sum().backward()
        return [out.detach(), xi.grad, wi.grad]

    # the hidden states' gradient is the row gather's backward, a bf16 sum: one rounding step
    for name, got, want, bound in zip(("out", "dx", "dw"), run(shipped), run(with_torch),
                                      (1e-5, 2 ** -7, 1e-4), strict=True):
        err = (got - want).abs().max()
        assert err <= bound * want.abs().max(), (name, float(err), float(want.abs().max()))
