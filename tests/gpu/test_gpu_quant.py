"""GPU tests (skipped without CUDA): the int8 experts' one-pass dequantize."""

from __future__ import annotations

import pytest
import torch

from vlpack.model import quant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("shape", [(8, 256, 128), (8, 128, 64)])  # gate_up- and down-like
def test_one_pass_dequantize_on_the_gpu_equals_cast_then_scale(shape) -> None:
    """`dequantize` on CUDA gives the cast-then-scale's bf16 weight bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda", generator=g)
    s = torch.rand(shape[:2], device="cuda", generator=g) * 1e-3 + 1e-6
    want = q.to(torch.bfloat16).mul_(s.unsqueeze(-1))
    got = quant.dequantize(q, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
