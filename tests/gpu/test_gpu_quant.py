"""GPU tests (skipped without CUDA): the int8 experts' one-kernel dequantize."""

from __future__ import annotations

import pytest
import torch

from vlpack.model import quant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("shape", [(8, 256, 128), (8, 128, 64)])  # gate_up- and down-like
def test_fused_dequantize_on_the_gpu_equals_cast_then_scale(shape) -> None:
    """`dequantize` on CUDA (the compiled cast-and-scale) gives the eager cast-then-scale's
    bf16 weight bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda", generator=g)
    s = torch.rand(shape[:2], device="cuda", generator=g) * 1e-3 + 1e-6
    want = q.to(torch.bfloat16).mul_(s.unsqueeze(-1))
    got = quant.dequantize(q, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_int8_experts_in_the_compiled_dispatch_compile_their_dequantize_once_or_twice() -> None:
    """The int8 experts under the compiled dispatch (the recipe's `model.compile=true`), forward
    and backward under bf16 autocast: within twice the error of transformers' per-expert loop in
    plain bf16 against that loop in float32, and the dequantize runs compiled (it is called from
    inside the compiled dispatch's opaque int8 op and from the backward) with few graphs, far
    below dynamo's recompile limit, past which it would run eager."""
    import copy

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tests.model.test_quant import _int8_and_reference

    ex, ref, x, idx, w = (t.cuda() for t in _int8_and_reference())
    ex.config._experts_implementation = "vlpack_grouped_mm_compiled"

    def run(module, autocast: bool, dtype=torch.float32):
        xi, wi = (t.to(dtype).clone().requires_grad_() for t in (x, w))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = module(xi, idx, wi)
        y.float().pow(2).sum().backward()
        return [y.float(), xi.grad.float(), wi.grad.float()]

    truth = run(ref, autocast=False)
    plain = run(copy.deepcopy(ref).bfloat16(), autocast=False, dtype=torch.bfloat16)
    for _ in range(3):
        fast = run(ex, autocast=True)
    for f, p, t in zip(fast, plain, truth, strict=True):
        e_fast, e_plain = (f - t).abs().max(), (p - t).abs().max()
        assert e_fast <= 2 * e_plain + 1e-6 * t.abs().max(), (float(e_fast), float(e_plain))
    graphs = len(_debug_get_cache_entry_list(quant._cast_and_scale.__code__))
    assert 1 <= graphs <= 4, graphs
