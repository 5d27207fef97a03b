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
