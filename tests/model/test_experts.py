"""Routed experts under autocast (model/experts.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import tiny_routed_experts
from vlpack.model import build_model


@pytest.mark.parametrize("impl", ["vlpack_grouped_mm", "vlpack_grouped_mm_compiled"])
def test_experts_under_autocast_meet_the_bf16_rule(impl: str):
    """vlpack's experts (bf16 grouped GEMMs under autocast, fp32 weights), eager and with the
    dispatch compiled, against transformers' per-expert loop: in fp32 (the truth) and in bf16
    weights (the plain bf16 error); outputs and gradients within 2× the plain error. Outside
    autocast they equal transformers' grouped_mm to float32 rounding; the stock model keeps
    transformers' implementation."""
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
    torch.testing.assert_close(ex(x, idx, w), grouped_mm_experts_forward(ex, x, idx, w),
                               rtol=1e-5, atol=1e-6)

    def run(module, dtype, autocast):
        m = copy.deepcopy(module).to(dtype)
        m.config._experts_implementation = "eager" if not autocast else impl
        xi = x.to(dtype if not autocast else torch.float32).clone().requires_grad_()
        wi = w.to(xi.dtype).clone().requires_grad_()  # the router's weights get gradients too
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(xi, idx, wi)
        assert y.dtype == xi.dtype
        y.float().pow(2).sum().backward()
        return [y.float(), xi.grad.float(), wi.grad.float(), m.gate_up_proj.grad.float(),
                m.down_proj.grad.float()]

    truth = run(ex, torch.float32, False)
    plain = run(ex, torch.bfloat16, False)
    fast = run(ex, torch.float32, True)
    for t, p, f in zip(truth, plain, fast, strict=True):
        e_fast, e_plain = (f - t).abs().max(), (p - t).abs().max()
        assert e_fast <= 2 * e_plain + 1e-6 * t.abs().max(), (float(e_fast), float(e_plain))


@pytest.mark.parametrize("impl", ["vlpack_grouped_mm", "vlpack_grouped_mm_compiled"])
def test_frozen_experts_keep_no_hidden_wide_routed_rows_for_backward(impl: str):
    """With frozen experts (a LoRA run) under bf16 autocast, eager and compiled, autograd keeps
    no P × D tensor for backward: the routing weight scales the down projection's P × I input,
    so its gradient needs that input, not the P × D output (I = 16 here, D = 64)."""
    ex = tiny_routed_experts(impl)
    g = torch.Generator().manual_seed(0)
    T, K = 53, 2
    x = torch.randn(T, ex.hidden_dim, generator=g, requires_grad=True)
    idx = torch.randint(0, ex.num_experts, (T, K), generator=g)
    w = torch.rand(T, K, generator=g, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        ex(x, idx, w).float().sum().backward()
    assert w.grad is not None and x.grad is not None
    rows = [shape for shape in saved if len(shape) == 2 and shape[0] == T * K]
    assert rows and (T * K, ex.hidden_dim) not in rows, saved


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


def test_compiled_dispatch_keeps_the_experts_per_token_static():
    """The compiled dispatch serves every token count with one graph, while K (experts per
    token) is a constant of its graph: another K compiles a new one. A symbolic K made the sum
    over each token's K outputs a looped reduction of unknown length (experts.py)."""
    from torch._dynamo.utils import counters

    from vlpack.model import experts

    model, _ = build_model("tiny-qwen3_5_moe", device="cpu")
    ex = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    graphs = []
    for T, K in ((37, 2), (50, 2), (23, 2), (41, 3)):
        x = torch.randn(T, ex.hidden_dim, generator=g, requires_grad=True)
        w, idx = torch.randn(T, ex.num_experts, generator=g).softmax(-1).topk(K)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts.vlpack_experts_forward_compiled(ex, x, idx, w)
        out.float().sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:3] == [graphs[0]] * 2, graphs  # T is dynamic
    assert graphs[3] > graphs[2], graphs  # K is not


def test_compiled_layers_train_the_moe_model_through_the_compiled_dispatch():
    """A packed step of the hybrid MoE family under bf16 autocast with whole layers compiled
    runs every layer's routed experts through the compiled dispatch, and its loss and
    gradients stay within bf16 error of the eager model's."""
    import numpy as np

    from vlpack.data.batch import build_thd_batch
    from vlpack.model import experts
    from vlpack.model.compile import compile_layers
    from vlpack.model.synthetic import synthetic_sample
    from vlpack.train.setup.module import TrainModule

    calls = []
    compiled = experts._compiled_silu_dispatch()

    def counting(*args):
        calls.append(args[0].shape[0])
        return compiled(*args)

    def step(compile_: bool):
        model, spec = build_model("tiny-qwen3_5_moe", device="cpu", seed=0)
        if compile_:
            compile_layers(model)
        module = TrainModule(model, spec, loss_method="chunked")
        rng = np.random.default_rng(0)
        group = [synthetic_sample(spec, rng, "a", text_len=40, grids=[(1, 4, 4)]),
                 synthetic_sample(spec, rng, "b", text_len=24, grids=[])]
        batch = build_thd_batch(group, pad_token_id=spec.pad_token_id,
                pad_to_multiple_of=1, mrope_after_video="transformers")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(batch)
        out.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return float(out.loss_sum), grads, model.config.text_config.num_hidden_layers

    loss_eager, g_eager, layers = step(False)
    original = experts._compiled_silu_dispatch
    experts._compiled_silu_dispatch = lambda: counting
    try:
        loss_fast, g_fast, _ = step(True)
    finally:
        experts._compiled_silu_dispatch = original
    assert len(calls) == layers, calls  # each MoE layer's forward, once
    assert abs(loss_fast - loss_eager) <= 2e-2 * abs(loss_eager), (loss_fast, loss_eager)
    assert set(g_fast) == set(g_eager)
    worst = max(float((g_fast[n] - g_eager[n]).norm() / g_eager[n].norm().clamp(min=1e-12))
                for n in g_eager)
    assert worst < 0.1, worst
