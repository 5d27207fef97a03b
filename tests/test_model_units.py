"""Unit tests of the model side: presets/build, attention guards, vision varlen, GDN, loss."""

from __future__ import annotations

import copy
import pickle
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlpack.data.batch import build_thd_batch
from vlpack.model import attention, build_model, gdn
from vlpack.model.loss import chunked_linear_ce_sum, linear_ce_sum, plain_ce_sum
from vlpack.model.presets import PRESETS, get_preset, reduced_depth
from vlpack.model.synthetic import default_mix


# --- presets and build -------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny-")])
def test_tiny_presets_use_real_token_ids(name):
    from vlpack.model.build import _spec, preset_config

    p = get_preset(name)
    cfg = preset_config(p)
    spec = _spec(name, cfg, "sdpa")
    if p.family.startswith("qwen3_5"):
        assert (spec.vocab_size, spec.image_token_id, spec.vision_start_token_id) == \
            (248320, 248056, 248053)
        assert {"linear_attention", "full_attention"} <= set(cfg.text_config.layer_types)
    else:
        assert (spec.vocab_size, spec.image_token_id, spec.vision_start_token_id,
                spec.vision_end_token_id, spec.video_token_id, spec.eos_token_id,
                spec.pad_token_id) == (151936, 151655, 151652, 151653, 151656, 151645, 151643)
    assert 2 <= cfg.text_config.num_hidden_layers <= 4 and cfg.text_config.hidden_size <= 128
    assert cfg.vision_config.depth == 2 and cfg.tie_word_embeddings
    if spec.is_moe:
        assert spec.num_experts >= 4


def test_real_presets_name_their_source():
    for name in ("qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-35b-a3b"):
        assert get_preset(name).source


@pytest.mark.parametrize(("name", "billions"), [
    ("qwen3-vl-2b", 2.13), ("qwen3-vl-8b", 8.77), ("qwen3-vl-30b-a3b", 31.07),
    ("qwen3.5-35b-a3b", 35.11),
])
def test_real_presets_build_on_meta(name, billions):
    """Shapes only (meta device); a guard on the preset shapes: totals fit the model names."""
    model, spec = build_model(name, device="meta", dtype="bfloat16")
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(total - billions) < 0.01, total
    assert spec.has_gdn == name.startswith("qwen3.5") and spec.is_moe == ("-a3b" in name)


def test_reduced_depth_keeps_the_shape_and_the_hybrid_pattern():
    """The benchmarks' cut-down 35B: 4 text layers (3 Gated-DeltaNet + 1 attention), same widths."""
    name = reduced_depth("qwen3.5-35b-a3b", 4)
    assert reduced_depth("qwen3.5-35b-a3b", 4) == name == "qwen3.5-35b-a3b-4L"
    model, spec = build_model(name, device="meta", dtype="bfloat16")
    text = model.config.text_config
    assert text.num_hidden_layers == len(model.model.language_model.layers) == 4
    assert list(text.layer_types) == ["linear_attention"] * 3 + ["full_attention"]
    full = get_preset("qwen3.5-35b-a3b").text
    assert text.hidden_size == full["hidden_size"] and text.num_experts == full["num_experts"]
    assert spec.has_gdn and spec.is_moe
    with pytest.raises(ValueError, match="between 1 and"):
        reduced_depth("qwen3.5-35b-a3b", 41)


def test_unknown_preset_says_what_to_do():
    with pytest.raises(ValueError, match="preset"):
        build_model("tiny-nope", device="cpu")


def test_build_from_folder(tmp_path):
    model, spec = build_model("tiny-qwen3_vl", device="cpu")
    model.save_pretrained(tmp_path / "full")
    again, spec2 = build_model(str(tmp_path / "full"), device="cpu", seed=123)
    assert spec2.family == "qwen3_vl" and spec2.image_token_id == spec.image_token_id
    w = "model.language_model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(dict(model.named_parameters())[w], dict(again.named_parameters())[w])
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"config.json but no weights .*model.init=random"):
        build_model(str(tmp_path / "cfg"), device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_model(str(tmp_path / "cfg"), device="cpu", random_init=True)
    assert any("RANDOM" in str(w.message) for w in caught)


# --- attention ------------------------------------------------------------------------------------
def _qkv(T=40, H=4, K=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, T, D, generator=g), torch.randn(1, K, T, D, generator=g),
            torch.randn(1, K, T, D, generator=g))


class _Causal(torch.nn.Module):
    is_causal = True


def _mask_reference(q, k, v, cu, causal):
    T = q.shape[2]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu))
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("name", ["vlpack_varlen", "vlpack_flex"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_backends_equal_masked_sdpa(name, causal):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q, k, v = _qkv()
    cu = torch.tensor([0, 7, 8, 24, 40], dtype=torch.int32)
    module = _Causal()  # a bidirectional call counts its cu only from a wrapped vision module
    module.config = SimpleNamespace(vlpack_vision_varlen=not causal, _attn_implementation=name)
    out, _ = ALL_ATTENTION_FUNCTIONS[name](module, q, k, v, None, scaling=8**-0.5,
                                           cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=16,
                                           max_length_k=16, is_causal=causal)
    assert (out - _mask_reference(q, k, v, cu.long(), causal)).abs().max() < 1e-5


def test_attention_rejects_boundaries_not_covering_the_row():
    q, k, v = _qkv()
    bad = torch.tensor([0, 10, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        attention.varlen_attention_forward(_Causal(), q, k, v, None, cu_seq_lens_q=bad)


def test_attention_refuses_padded_batches_and_windows():
    q, k, v = (t.expand(2, -1, -1, -1) for t in _qkv())
    with pytest.raises(ValueError, match="sdpa"):
        attention.varlen_attention_forward(_Causal(), q, k, v, torch.ones(2, 1, 40, 40))
    with pytest.raises(ValueError, match="sliding"):
        attention.varlen_attention_forward(_Causal(), *_qkv(), None, sliding_window=16)


def test_gqa_probe_is_invisible_to_activation_checkpointing(monkeypatch):
    """The one-time GQA probe runs a forward and a backward. Inside a checkpointed layer (the
    first text layer under `checkpoint_share`) its saved tensors counted as the layer's, and the
    recomputation, finding the answer cached, saved fewer: CheckpointError on the 8B recipe.
    The caller's saved-tensor hooks must see none of the probe's tensors."""

    def differentiable_stand_in(q, k, v, cu, max_len, causal, scale, *, repeat):
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return q * k * v  # saves tensors for backward, as the kernel does

    monkeypatch.setattr(attention, "_torch_varlen_call", differentiable_stand_in)
    attention._torch_varlen_gqa.cache_clear()
    packed = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            assert attention._torch_varlen_gqa(torch.device("cpu"), torch.float32)
    finally:
        attention._torch_varlen_gqa.cache_clear()
    assert packed == []


def test_vision_call_outside_wrapper_ignores_text_cu_kwargs():
    """transformers 5.17 hands the TEXT cu kwargs to per-image vision calls: ignore them."""
    q, k, v = _qkv(K=4)
    vis = _Causal()
    vis.is_causal = False
    text_cu = torch.tensor([0, 100, 300], dtype=torch.int32)  # would read out of bounds
    out, _ = attention.varlen_attention_forward(vis, q, k, v, None, cu_seq_lens_q=text_cu,
                                                cu_seq_lens_k=text_cu, max_length_q=200,
                                                is_causal=False)
    ref = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["tiny-qwen3_vl", "tiny-qwen2_5_vl"])
def test_vision_tower_guard_and_one_call_per_layer(name, monkeypatch):
    """Text cu kwargs reaching the ViT (as in 5.17) change nothing; each layer makes one call."""
    model, spec = build_model(name, device="cpu")
    samples = default_mix(spec, 4, seed=0)
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                            spatial_merge_size=spec.merge_size)
    calls = []
    real = attention._run_kernel

    def spy(name_, stream, q, k, v, cu, *a):
        calls.append((stream, cu.tolist()))
        return real(name_, stream, q, k, v, cu, *a)

    monkeypatch.setattr(attention, "_run_kernel", spy)
    visual = model.model.visual
    with torch.no_grad():
        clean = visual(batch.pixel_values, grid_thw=batch.image_grid_thw)
        n_clean = len(calls)
        cu = batch.cu_seqlens_padded
        dirty = visual(batch.pixel_values, grid_thw=batch.image_grid_thw, cu_seq_lens_q=cu,
                       cu_seq_lens_k=cu, max_length_q=batch.max_seqlen,
                       max_length_k=batch.max_seqlen)
    get = (lambda o: o.pooler_output) if hasattr(clean, "pooler_output") else (lambda o: o)
    assert torch.equal(get(clean), get(dirty))
    depth = model.config.vision_config.depth
    assert n_clean == depth and all(s == "vision" for s, _ in calls)
    full = [c for _, c in calls[:depth] if c == batch.vision_cu_seqlens.tolist()]
    assert full, "no vision layer saw the per-image boundaries of the batch"
    if spec.family == "qwen2_5_vl":  # windowed layers see finer (window) boundaries
        assert any(len(c) > len(batch.vision_cu_seqlens) for _, c in calls[:depth])


# --- GDN ------------------------------------------------------------------------------------------
def test_segment_conv_restarts_at_boundaries():
    x = torch.randn(1, 6, 20)
    w, b = torch.randn(6, 4), torch.randn(6)
    cu = torch.tensor([0, 3, 11, 20])
    y = gdn.segment_conv1d(x, w, b, "silu", cu)
    for s, e in [(0, 3), (3, 11), (11, 20)]:
        ref = F.silu(F.conv1d(x[:, :, s:e], w[:, None], b, padding=3, groups=6)[:, :, : e - s])
        assert (y[:, :, s:e] - ref).abs().max() < 1e-6
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        gdn.segment_conv1d(x, w, b, "silu", torch.tensor([0, 5, 5, 20]))


def test_fla_gets_one_boundary_tensor_pair_per_forward():
    """Every GDN layer of a forward hands fla the same cu_seqlens objects (fla caches its chunk
    indices by identity: new objects per layer would cost a host sync per layer); a new or
    modified boundary tensor gets fresh ones."""
    def fla_fn(x, cu_seqlens=None, cu_seqlens_cpu=None):
        return x

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    first = gdn._fla_bounds(fla_fn, cu, (0, 5, 12), "cpu")
    again = gdn._fla_bounds(fla_fn, cu, (0, 5, 12), "cpu")
    assert first["cu_seqlens"] is again["cu_seqlens"]
    assert first["cu_seqlens_cpu"] is again["cu_seqlens_cpu"]
    assert first["cu_seqlens"].dtype == torch.long and first["cu_seqlens_cpu"].tolist() == [0, 5, 12]
    other = gdn._fla_bounds(fla_fn, torch.tensor([0, 12], dtype=torch.int32), (0, 12), "cpu")
    assert other["cu_seqlens"].tolist() == [0, 12]
    cu[1] = 6  # modified in place: the cached copies are stale
    changed = gdn._fla_bounds(fla_fn, cu, (0, 6, 12), "cpu")
    assert changed["cu_seqlens"].tolist() == [0, 6, 12] and changed["cu_seqlens_cpu"].tolist() == [0, 6, 12]
    assert "cu_seqlens_cpu" not in gdn._fla_bounds(lambda x, cu_seqlens=None: x, cu, (0, 6, 12), "cpu")
    # the same boundaries asked for on another device get a tensor on that device
    assert gdn._fla_bounds(fla_fn, cu, (0, 6, 12), "meta")["cu_seqlens"].device.type == "meta"
    assert gdn._fla_bounds(fla_fn, cu, (0, 6, 12), "cpu")["cu_seqlens"] is changed["cu_seqlens"]


def test_gdn_dispatch_is_inactive_outside_vlpack_modules():
    """Stock models in the same process keep the stock kernel (5.23+: it raises on cu_seqlens;
    5.17: it computes without boundaries): vlpack's dispatcher must not change that."""
    build_model("tiny-qwen3_5", device="cpu")  # installs the module-level dispatchers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    dispatcher = m.torch_chunk_gated_delta_rule
    assert getattr(dispatcher, "_vlpack", False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(3))
    kw = dict(g=-torch.rand(1, 8, 2, generator=g), beta=torch.rand(1, 8, 2, generator=g),
              use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 4, 8]))
    try:
        want = dispatcher.__wrapped__(q, k, v, **kw)[0]
    except ValueError:
        with pytest.raises(ValueError):
            dispatcher(q, k, v, **kw)
        return
    assert torch.equal(dispatcher(q, k, v, **kw)[0], want)


# --- loss -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_chunked_loss_equals_plain(chunk):
    g = torch.Generator().manual_seed(0)
    T, H, V = 37, 16, 3001
    h1 = torch.randn(T, H, generator=g, requires_grad=True)
    w1 = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::3] = -100
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    want = plain_ce_sum(h1 @ w1.T, labels)
    got = chunked_linear_ce_sum(h2, w2, labels, chunk_size=chunk)
    (2.0 * want).backward()
    (2.0 * got).backward()
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-5 * abs(float(want.detach()))
    for a, b in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_chunked_loss_under_bf16_autocast_matches_plain():
    """Under autocast the chunked loss runs its matmuls in bf16 (weight gradient included) and
    stays within bf16 rounding of the plain path run under the same autocast."""
    g = torch.Generator().manual_seed(0)
    T, H, V = 64, 32, 3001
    h1 = torch.randn(T, H, generator=g, requires_grad=True)
    w1 = (0.1 * torch.randn(V, H, generator=g)).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::4] = -100
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain_ce_sum(h1 @ w1.T, labels)
        got = chunked_linear_ce_sum(h2, w2, labels, chunk_size=16)
    want.backward()
    got.backward()
    assert got.dtype == torch.float32 and w2.grad.dtype == torch.float32
    assert abs(float(got) - float(want)) <= 1e-2 * abs(float(want))
    for a, b in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.abs().max()


@pytest.mark.parametrize("weights", ["bf16 parameters", "fp32 under bf16 autocast"])
def test_chunked_loss_weight_gradient_runs_in_half_precision(weights):
    """The [V, H] weight-gradient product runs in bf16 whether the bf16 comes from the weights
    themselves (FSDP2's parameter dtype, no autocast) or from autocast: in fp32 it is the
    largest matmul of the loss on CUDA cores."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.seen.append((tuple(out.shape), out.dtype))
            return out

    g = torch.Generator().manual_seed(0)
    T, H, V = 40, 16, 3001
    dtype = torch.bfloat16 if weights == "bf16 parameters" else torch.float32
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (0.1 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    auto = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32)
    with auto, Matmuls() as spy:
        chunked_linear_ce_sum(h, w, labels, chunk_size=16)
    weight_grads = [dt for shape, dt in spy.seen if shape == (V, H)]
    assert weight_grads and set(weight_grads) == {torch.bfloat16}, spy.seen


def test_loss_counts_labels_and_never_shifts():
    lm = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(6, 8)
    labels = torch.tensor([3, -100, 7, 7, -100, -100])
    for method in ("plain", "chunked"):
        s, n = linear_ce_sum(h, lm, labels, method=method)
        assert n == 3
        want = F.cross_entropy(lm(h), labels, ignore_index=-100, reduction="sum")
        assert abs(float(s) - float(want)) < 1e-5
    s, n = linear_ce_sum(h, lm, torch.full((6,), -100), method="chunked")
    assert n == 0 and float(s) == 0.0


def test_frozen_lm_head_gets_no_grad():
    lm = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    h = torch.randn(6, 8, requires_grad=True)
    s, _ = linear_ce_sum(h, lm, torch.tensor([1, 2, 3, 4, 5, 6]), method="chunked")
    s.backward()
    assert lm.weight.grad is None and h.grad is not None


def test_check_samples_are_valid_for_the_batch_builder():
    _model, spec = build_model("tiny-qwen3_5", device="cpu")
    for s in default_mix(spec, 8, seed=5):
        assert s.pixel_values is None or s.pixel_values.shape[1] == spec.patch_dim
        assert np.all(s.labels[s.mm_token_type_ids != 0] == -100)


def test_host_bounds_cache_tracks_identity_and_version():
    from vlpack.model.bounds import host_bounds

    cu = torch.tensor([0, 3, 7])
    assert host_bounds(cu) == (0, 3, 7) == host_bounds(cu)
    cu[1] = 4  # in-place change bumps the version counter: no stale values
    assert host_bounds(cu) == (0, 4, 7)
    assert host_bounds(torch.tensor([0, 3, 7])) == (0, 3, 7)
    with torch.inference_mode():
        assert host_bounds(torch.tensor([0, 5])) == (0, 5)


def test_vision_varlen_mark_lives_on_a_view_not_in_the_saved_config():
    """The wrapped vision attention modules see a marked view of their config; the model's own
    config (what checkpoints save) carries no mark, and writes through the view reach it."""
    model, _ = build_model("tiny-qwen3_vl", device="cpu")
    views = [m.config for m in model.modules() if attention.is_vision_attention(m)]
    assert views and all(isinstance(c, attention.VisionVarlenConfig) for c in views)
    assert all(c.vlpack_vision_varlen and c._attn_implementation == attention.VARLEN
               for c in views)
    assert "vlpack_vision_varlen" not in model.config.to_json_string()
    views[0].vlpack_probe = 3  # a write through the view lands on the shared config
    assert model.config.vision_config.vlpack_probe == 3
    twin = copy.deepcopy(model)  # a copy's views read the copy's config, not the original's
    twin_view = next(m.config for m in twin.modules() if attention.is_vision_attention(m))
    assert twin_view._config is twin.config.vision_config is not model.config.vision_config
    assert pickle.loads(pickle.dumps(views[0])).vlpack_probe == 3
