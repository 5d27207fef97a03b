"""Routed experts under autocast (model/experts.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from vlpack.model import build_model


@pytest.mark.parametrize("impl", ["vlpack_grouped_mm", "vlpack_grouped_mm_compiled"])
def test_experts_under_autocast_meet_the_bf16_rule(impl: str):
    """vlpack's experts (bf16 grouped GEMMs under autocast, fp32 weights), eager and with the
    dispatch compiled, against transformers' per-expert loop: in fp32 (the truth) and in bf16
    weights (the plain bf16 error); outputs and gradients within 2× the plain error. Outside
    autocast they are transformers' grouped_mm, bitwise; the stock model keeps transformers'
    implementation."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    model, _ = build_model("tiny-qwen3_5_moe", device="cpu")
    stock, _ = build_model("tiny-qwen3_5_moe", backend="sdpa", device="cpu")
    assert model.config.text_config._experts_implementation == "vlpack_grouped_mm"
    assert stock.config.text_config._experts_implementation == "grouped_mm"
    ex = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    g = torch.Generator().manual_seed(0)
    T, K = 53, 2
    x = torch.randn(T, ex.hidden_dim, generator=g)
    idx = torch.randint(0, ex.num_experts, (T, K), generator=g)
    idx[:5] = 0  # one expert gets many rows, and some get none
    w = torch.rand(T, K, generator=g)
    ex.config._experts_implementation = impl
    assert torch.equal(ex(x, idx, w), grouped_mm_experts_forward(ex, x, idx, w))

    def run(module, dtype, autocast):
        m = copy.deepcopy(module).to(dtype)
        m.config._experts_implementation = "eager" if not autocast else impl
        xi = x.to(dtype if not autocast else torch.float32).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(xi, idx, w.to(xi.dtype))
        assert y.dtype == xi.dtype
        y.float().pow(2).sum().backward()
        return [y.float(), xi.grad.float(), m.gate_up_proj.grad.float(), m.down_proj.grad.float()]

    truth = run(ex, torch.float32, False)
    plain = run(ex, torch.bfloat16, False)
    fast = run(ex, torch.float32, True)
    for t, p, f in zip(truth, plain, fast, strict=True):
        e_fast, e_plain = (f - t).abs().max(), (p - t).abs().max()
        assert e_fast <= 2 * e_plain + 1e-6 * t.abs().max(), (float(e_fast), float(e_plain))


@pytest.mark.parametrize("scope", ["regions", "layers"])
def test_compiling_a_moe_model_compiles_its_experts_dispatch(scope: str):
    """Both compile scopes switch vlpack's experts to the compiled dispatch; the stock model's
    experts and a dense model are left as they are."""
    from vlpack.model.compile import compile_layers, compile_regions

    compile_fn = compile_regions if scope == "regions" else compile_layers
    model, _ = build_model("tiny-qwen3_5_moe", device="cpu")
    assert "vlpack_experts_dispatch" in compile_fn(model)
    assert model.config.text_config._experts_implementation == "vlpack_grouped_mm_compiled"
    stock, _ = build_model("tiny-qwen3_5_moe", backend="sdpa", device="cpu")
    assert "vlpack_experts_dispatch" not in compile_fn(stock)
    assert stock.config.text_config._experts_implementation == "grouped_mm"
    dense, _ = build_model("tiny-qwen3_vl", device="cpu")
    assert "vlpack_experts_dispatch" not in compile_fn(dense)
