"""The routed experts' frozen weights in int8 (model/quant.py, `model.frozen_dtype=int8`)."""

from __future__ import annotations

import copy

import pytest
import torch

from vlpack.model import build_model
from vlpack.model.quant import dequantize, quantize_experts, quantize_rows


def _experts(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def test_rows_quantize_as_worked_by_hand():
    """Literal rows: scale = max|row| / 127.5; round half to even, clamped to [-128, 127]."""
    w = torch.tensor([[[-1.9921875, 0.5, 0.0, 0.2421875, 0.2265625],
                       [1.9921875, -1.0, 0.0, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0]]])
    q, s = quantize_rows(w)
    # max|row| = 127.5 / 64, so scale = 1/64 and w / scale = 64 w exactly:
    # -127.5 → -128, 32, 0, 15.5 → 16, 14.5 → 14 (half to even); +127.5 → 128, clamped to 127;
    # a zero row keeps zeros with the smallest normal float32 as its scale
    assert q.tolist() == [[[-128, 32, 0, 16, 14], [127, -64, 0, 0, 0], [0, 0, 0, 0, 0]]]
    assert s.tolist() == [[1 / 64, 1 / 64, torch.finfo(torch.float32).tiny]]
    assert dequantize(q, s, torch.float32)[0, 0].tolist() == [-2.0, 0.5, 0.0, 0.25, 0.21875]


def test_one_pass_dequantize_equals_cast_then_scale_bit_for_bit():
    """`dequantize` (one multiply of the int8 codes by the scales, stored in the compute dtype)
    against the cast and then the in-place scale, in bf16 and float32, on random codes and
    scales spanning 12 binades."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (4, 24, 40), dtype=torch.int8, generator=g)
    s = torch.exp2(torch.randint(-20, -8, (4, 24), generator=g).float()) * (
        1 + torch.rand(4, 24, generator=g))
    for dtype in (torch.bfloat16, torch.float32):
        got, want = dequantize(q, s, dtype), q.to(dtype).mul_(s.unsqueeze(-1))
        assert got.dtype == dtype and torch.equal(got, want), dtype


def test_rows_quantize_as_torchao_does():
    """Symmetric int8 with a scale per row equals torchao's choose_qparams_affine +
    quantize_affine (MappingType.SYMMETRIC, a block of one row) bit for bit, an all-zero row
    included; the dequantized weight is within half a step of the original. torchao is not a
    dependency: .ci/run installs it after the main suite and runs this file again."""
    tq = pytest.importorskip("torchao.quantization.quant_primitives")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 40, 72, generator=g) * torch.rand(3, 40, 1, generator=g)).bfloat16()
    w[1, 7] = 0
    q, s = quantize_rows(w)
    block = (1, 1, w.shape[-1])
    s_ref, zp = tq.choose_qparams_affine(w.float(), tq.MappingType.SYMMETRIC, block, torch.int8)
    q_ref = tq.quantize_affine(w.float(), block, s_ref, zp, torch.int8)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 40)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref.reshape(s.shape)) and not zp.any()
    back = dequantize(q, s, torch.float32)
    assert ((back - w.float()).abs() <= s.unsqueeze(-1) * (0.5 + 1e-5)).all()
    assert int(q.min()) >= -128 and int(q.max()) <= 127 and int(q.abs().max()) >= 127


def _int8_and_reference(seed: int = 0):
    """A tiny MoE model's first experts module with int8 weights, and a float32 copy that holds
    the dequantized weights and runs transformers' per-expert loop (no vlpack code)."""
    model, _ = build_model("tiny-qwen3_5_moe", device="cpu")
    model.requires_grad_(False)
    ex = _experts(model)[0]
    ref = copy.deepcopy(ex)
    assert quantize_experts(model, torch.device("cpu")) == 2 * len(_experts(model))
    assert ex.gate_up_proj.dtype == ex.down_proj.dtype == torch.int8
    with torch.no_grad():
        ref.gate_up_proj.copy_(dequantize(ex.gate_up_proj, ex.gate_up_proj_scale, torch.float32))
        ref.down_proj.copy_(dequantize(ex.down_proj, ex.down_proj_scale, torch.float32))
    ref.config = copy.copy(ref.config)
    ref.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    T, K = 41, 2
    x = torch.randn(T, ex.hidden_dim, generator=g)
    idx = torch.randint(0, ex.num_experts, (T, K), generator=g)
    idx[:6] = 1  # one expert gets many rows, some get none
    w = torch.rand(T, K, generator=g)
    return ex, ref, x, idx, w


def _run(module, x, idx, w, autocast: bool):
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(xi, idx, wi)
    y.float().pow(2).sum().backward()
    return [y.float(), xi.grad, wi.grad]


@pytest.mark.parametrize("impl", ["vlpack_grouped_mm", "vlpack_grouped_mm_compiled"])
def test_int8_experts_equal_the_loop_over_their_dequantized_weights(impl: str):
    """In float32 (outside autocast) vlpack's dispatch over int8 weights equals transformers'
    per-expert loop over the dequantized float32 weights: output, the hidden states' gradient
    (the int8 backward dequantizes again) and the routing weights' gradient. Under bf16
    autocast, eager and compiled, within twice the error of the loop in bf16."""
    ex, ref, x, idx, w = _int8_and_reference()
    ex.config._experts_implementation = impl
    exact = _run(ex, x, idx, w, autocast=False)
    truth = _run(ref, x, idx, w, autocast=False)
    for a, b in zip(exact, truth, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), impl
    plain = _run(copy.deepcopy(ref).bfloat16(), x.bfloat16(), idx, w.bfloat16(), autocast=False)
    fast = _run(ex, x, idx, w, autocast=True)
    for f, p, t in zip(fast, plain, truth, strict=True):
        e_fast, e_plain = (f.float() - t).abs().max(), (p.float() - t).abs().max()
        assert e_fast <= 2 * e_plain + 1e-6 * t.abs().max(), (impl, float(e_fast), float(e_plain))


@pytest.mark.parametrize("impl", ["vlpack_grouped_mm", "vlpack_grouped_mm_compiled"])
def test_the_int8_backward_keeps_no_dequantized_weight(impl: str):
    """Under bf16 autocast, eager and compiled, autograd keeps the int8 weights for backward,
    not a dequantized copy: every saved tensor with an expert weight's shape is int8 (the
    compiler would otherwise keep the bf16 weight that forward and backward both compute)."""
    ex, _, x, idx, w = _int8_and_reference()
    ex.config._experts_implementation = impl
    shapes = {tuple(ex.gate_up_proj.shape), tuple(ex.down_proj.shape)}
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        ex(x.clone().requires_grad_(), idx, w)
    kept = [dt for shape, dt in saved if shape in shapes]
    assert kept and all(dt == torch.int8 for dt in kept), saved


def test_packed_equals_unpacked_with_int8_experts():
    """Packed ≡ unpacked holds over int8 experts (float32, per-segment kernels): vlpack's packed
    row over the int8 weights against the stock model, each sample alone, over a copy holding
    the dequantized float32 weights (transformers' own experts code, no vlpack kernel)."""
    from vlpack.check.run import run_packed, run_unpacked
    from vlpack.model.synthetic import default_mix

    torch.manual_seed(0)
    model, spec = build_model("tiny-qwen3_5_moe", device="cpu", dtype=torch.float32)
    for m in _experts(model):
        m.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    quantize_experts(model, torch.device("cpu"))
    with torch.no_grad():
        for q, r in zip(_experts(model), _experts(ref_model), strict=True):
            r.gate_up_proj.copy_(dequantize(q.gate_up_proj, q.gate_up_proj_scale, torch.float32))
            r.down_proj.copy_(dequantize(q.down_proj, q.down_proj_scale, torch.float32))
    model.train()
    ref_model.train()
    samples = default_mix(spec, 4, seed=1)
    aligned = sum(-(-len(s) // 8) * 8 for s in samples)
    packed = run_packed(model, spec, samples, pad_to=8, total_len=aligned + 13)
    ref = run_unpacked(ref_model, spec, samples)
    for a, b in zip(packed.logits, ref.logits, strict=True):
        assert float((a - b).abs().max()) <= 1e-5
    assert abs(sum(packed.losses) - sum(ref.losses)) <= 1e-5 * abs(sum(ref.losses))
    assert ref.grads and set(packed.grads) == set(ref.grads)
    for n, g in ref.grads.items():
        assert float((packed.grads[n] - g).norm()) <= 1e-4 * max(float(g.norm()), 1e-3), n


def test_only_frozen_routed_experts_are_quantized():
    """A dense model has no routed experts, and trained experts are not quantized: each is a
    ValueError naming the setting to use."""
    dense, _ = build_model("tiny-qwen3_5", device="cpu")
    with pytest.raises(ValueError, match="no routed experts"):
        quantize_experts(dense, torch.device("cpu"), model_name="tiny-qwen3_5")
    moe, _ = build_model("tiny-qwen3_5_moe", device="cpu")
    with pytest.raises(ValueError, match="trains them"):
        quantize_experts(moe, torch.device("cpu"))


def test_meta_quantization_gives_the_shapes_and_dtypes():
    """On the meta device (the memory plan) the experts take int8 shapes and float32 scales."""
    from vlpack.model.build import meta_model

    model = meta_model("tiny-qwen3_5_moe")
    model.requires_grad_(False)
    quantize_experts(model, torch.device("meta"))
    ex = _experts(model)[0]
    assert ex.gate_up_proj.dtype == torch.int8 and ex.gate_up_proj.is_meta
    assert ex.gate_up_proj_scale.shape == ex.gate_up_proj.shape[:-1]
    assert ex.down_proj_scale.dtype == torch.float32
    assert "gate_up_proj_scale" not in dict(ex.state_dict())  # a resume quantizes again
