"""The experts' row sum (model/rows.py): the op against the torch expression on CPU, inside
torch.compile too, and the Triton kernel itself under Triton's interpreter where that is set up
(`TRITON_INTERPRET=1` with Triton importable; the GPU tests run it on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from vlpack.model import rows


def _case(T: int, K: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(T * K, D, generator=g).to(torch.bfloat16)
    return src, torch.randperm(T * K, generator=g)


def test_row_sum_by_hand():
    """Two tokens, two rows each, written out: token 0 sums rows 3 and 0, token 1 rows 1 and 2."""
    src = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [1000.0, 2000.0]])
    out = rows.gather_sum(src, torch.tensor([3, 0, 1, 2]), 2, torch.float32)
    assert torch.equal(out, torch.tensor([[1001.0, 2002.0], [110.0, 220.0]]))


@pytest.mark.parametrize("compiled", [False, True])
def test_row_sum_op_equals_the_torch_expression(compiled):
    fn = torch.compile(rows.gather_sum, dynamic=True) if compiled else rows.gather_sum
    for T, K, D in ((7, 8, 64), (3, 8, 40)):  # two sizes: one compiled graph serves both
        src, index = _case(T, K, D)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(fn(src, index, K, dtype), rows.reference(src, index, K, dtype))


@pytest.mark.skipif(rows.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton and TRITON_INTERPRET=1 (the kernel on CPU tensors)")
def test_row_sum_kernel_under_the_interpreter():
    """The kernel's float32 sums equal the torch expression's bit for bit, a width that is not
    a multiple of the block included. (The interpreter rounds float32 to bf16 towards zero, so
    bf16 output is compared on the GPU only.)"""
    import triton

    for T, K, D in ((7, 8, 2048), (3, 8, 1000), (4, 2, 33)):
        src, index = _case(T, K, D)
        out = torch.empty(T, D)
        rows._gather_sum_kernel[(T, triton.cdiv(D, rows.BLOCK_D))](src, index, out, D, K=K,
                                                                   BLOCK=rows.BLOCK_D)
        assert torch.equal(out, rows.reference(src, index, K, torch.float32))


def test_kernel_check_is_nothing_off_cuda():
    assert rows.check_kernel(torch.device("cpu"), 8) is None


@pytest.mark.parametrize("kernel", [False, True])
def test_compiled_dispatch_gradients_equal_the_eager_ones(kernel):
    """The experts' dispatch compiled with either row sum (the torch expression, or the op)
    against the same dispatch run eagerly, float32 hidden states (so the sum's cast to the
    hidden states' dtype is a no-op): output and gradients. Under torch 2.11 a forward that
    returned the no-op cast's alias got zero gradients when compiled; torch 2.13 does not show
    that bug, so only a torch 2.11 run of this test catches its return."""
    from vlpack.model.experts import _dispatch, _silu_gate

    g = torch.Generator().manual_seed(0)
    T, E, D, I, K = 60, 4, 32, 16, 2  # noqa: E741 (experts.py's legend)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(E, D, I, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(T, D, generator=g)
    w, idx = torch.randn(T, E, generator=g).softmax(-1).topk(K)

    def dispatch(xi, wi):
        return _dispatch(xi, idx, wi, gate_up, down, _silu_gate, torch.bfloat16, kernel=kernel)

    def run(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi)
        out.pow(2).sum().backward()
        return out.detach(), xi.grad, wi.grad

    # Inductor may fuse differently around the bf16 GEMMs: agreement to bf16 rounding
    for got, want in zip(run(torch.compile(dispatch, dynamic=True)), run(dispatch), strict=True):
        assert (got - want).norm() <= 2 ** -7 * want.norm(), float((got - want).norm() / want.norm())
