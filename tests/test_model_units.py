"""Unit tests of the model side: presets/build, attention guards, vision varlen, GDN, loss."""

from __future__ import annotations

import copy
import inspect
import itertools
import pickle
import typing
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlpack.data.batch import build_thd_batch
from vlpack.model import attention, build_model, gdn
from vlpack.model.bounds import Boundaries, Segments
from vlpack.model.forward import packed_forward, packed_model_inputs
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
    for name in ("qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-9b", "qwen3.5-35b-a3b"):
        assert get_preset(name).source


@pytest.mark.parametrize(("name", "billions"), [
    ("qwen3-vl-2b", 2.13), ("qwen3-vl-8b", 8.77), ("qwen3-vl-30b-a3b", 31.07),
    ("qwen3.5-35b-a3b", 35.11),
    # + its multi-token-prediction layer (0.24 B, not built) = the checkpoint's 9.65 B parameters
    # (19,306,216,416 bytes of bf16 in its safetensors index)
    ("qwen3.5-9b", 9.41),
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
    # by name, as a recipe's model.name: the first 8 layers (the pattern's second period)
    cut = get_preset("qwen3.5-35b-a3b-8L")
    assert cut.text["num_hidden_layers"] == 8
    assert cut.text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    with pytest.raises(ValueError, match="between 1 and"):
        get_preset("qwen3.5-35b-a3b-41L")


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
    """Text: the registered function with the forward's Boundaries; vision: `attend`, as the
    vision attention calls it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q, k, v = _qkv()
    host = (0, 7, 8, 24, 40)
    segs = Segments.from_host(host, torch.device("cpu"))
    if causal:
        out, _ = ALL_ATTENTION_FUNCTIONS[name](_Causal(), q, k, v, None, scaling=8**-0.5,
                                               vlpack_bounds=Boundaries(text=segs))
    else:
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))  # the ViT has no grouped heads
        paths = {}
        out = attention.attend(name, *(t[0].transpose(0, 1) for t in (q, k, v)), segs,
                               causal=False, scale=8**-0.5, paths=paths, stream="vision")[None]
        assert paths["vision"]
    ref = _mask_reference(q, k, v, torch.tensor(host), causal)
    assert (out - ref).abs().max() < 1e-5


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


@pytest.mark.parametrize("case", ["enable_gqa", "known release", "unknown"])
def test_grouped_heads_follow_the_varlen_signature(monkeypatch, case):
    """A varlen_attn whose signature has `enable_gqa` gets the grouped k/v heads as they are, with
    the flag; one without it gets them as they are on a release known to group them natively,
    and repeated to the query heads elsewhere. Decided without running a kernel."""
    seen = {}

    def with_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
        seen.update(heads=k.shape[1], enable_gqa=enable_gqa)
        return q

    def without(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        seen.update(heads=k.shape[1], enable_gqa=None)
        return q

    fn = with_gqa if case == "enable_gqa" else without
    monkeypatch.setattr(attention, "_torch_varlen",
                        lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    monkeypatch.setattr(attention, "NATIVE_GQA_TORCH", (release,) if case == "known release" else ())
    q, k, v = (t[0].transpose(0, 1) for t in _qkv())
    attention._torch_varlen_call(q, k, v, torch.tensor([0, 40]), 40, True, 0.1)
    assert attention.torch_varlen_native_gqa() is (case != "unknown")
    assert seen == {"enable_gqa": {"heads": 2, "enable_gqa": True},
                    "known release": {"heads": 2, "enable_gqa": None},
                    "unknown": {"heads": 4, "enable_gqa": None}}[case]


def test_vision_call_outside_vlpack_ignores_text_cu_kwargs():
    """A bidirectional call through the interface is stock transformers' per-image vision path:
    text cu kwargs there (transformers hands them to the ViT too) are not its boundaries."""
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
def test_vision_tower_one_call_per_layer_with_the_rows_boundaries(name, monkeypatch):
    """In a packed forward each vision layer makes one attention call over all images of the
    row, with the per-image (or, in Qwen2.5-VL's windowed layers, per-window) boundaries;
    the text cu kwargs handed to the tower change nothing."""
    model, spec = build_model(name, device="cpu")
    samples = default_mix(spec, 4, seed=0)
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                            spatial_merge_size=spec.merge_size)
    calls = []
    real = attention.attend

    def spy(name_, q, k, v, segs, **kw):
        calls.append((kw["stream"], segs.host))
        return real(name_, q, k, v, segs, **kw)

    monkeypatch.setattr(attention, "attend", spy)
    with torch.no_grad():
        out = packed_forward(model, batch, spec=spec, return_hidden=True)
    vision = [c for s, c in calls if s == "vision"]
    assert len(vision) == model.config.vision_config.depth
    assert tuple(batch.vision_cu_seqlens.tolist()) in vision
    if spec.family == "qwen2_5_vl":  # windowed layers see finer (window) boundaries
        assert any(len(c) > len(batch.vision_cu_seqlens) for c in vision)
    inputs = packed_model_inputs(model, batch, spec)
    with torch.no_grad():  # without the text kwargs (the tower drops them): the same features
        img = model.model.get_image_features(batch.pixel_values, batch.image_grid_thw,
                                             vlpack_bounds=inputs["vlpack_bounds"])
        dirty = model.model.get_image_features(batch.pixel_values, batch.image_grid_thw,
                                               **{k: v for k, v in inputs.items()
                                                  if k.startswith(("cu_", "max_", "vlpack"))})
    get = (lambda o: o.pooler_output) if hasattr(img, "pooler_output") else (lambda o: o)
    assert all(torch.equal(a, b) for a, b in zip(get(img), get(dirty), strict=True))
    assert torch.isfinite(out.hidden).all()


# --- GDN ------------------------------------------------------------------------------------------
def test_segment_conv_restarts_at_boundaries():
    x = torch.randn(1, 6, 20)
    w, b = torch.randn(6, 4), torch.randn(6)
    segs = Segments.from_host((0, 3, 11, 20), torch.device("cpu"))
    y = gdn.segment_conv1d(x, w, b, "silu", segs)
    for s, e in [(0, 3), (3, 11), (11, 20)]:
        ref = F.silu(F.conv1d(x[:, :, s:e], w[:, None], b, padding=3, groups=6)[:, :, : e - s])
        assert (y[:, :, s:e] - ref).abs().max() < 1e-6
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        gdn.segment_conv1d(x, w, b, "silu", Segments(torch.tensor([0, 5, 5, 20]), (0, 5, 5, 20), 15))


def test_fla_gets_one_boundary_tensor_pair_per_forward():
    """Every GDN layer of a forward hands fla the same cu_seqlens objects (fla caches its chunk
    indices by identity: new objects per layer would cost a host sync per layer); another
    forward's Boundaries get their own."""
    def fla_fn(x, cu_seqlens=None, cu_seqlens_cpu=None):
        return x

    segs = Segments.from_host((0, 5, 12), torch.device("cpu"))
    bounds = Boundaries(text=segs)
    first = gdn._fla_bounds(fla_fn, segs, bounds, "cpu")
    again = gdn._fla_bounds(fla_fn, segs, bounds, "cpu")
    assert first["cu_seqlens"] is again["cu_seqlens"]
    assert first["cu_seqlens_cpu"] is again["cu_seqlens_cpu"]
    assert first["cu_seqlens"].dtype == torch.long and first["cu_seqlens_cpu"].tolist() == [0, 5, 12]
    other = gdn._fla_bounds(fla_fn, segs, Boundaries(text=segs), "cpu")
    assert other["cu_seqlens"] is not first["cu_seqlens"]
    assert "cu_seqlens_cpu" not in gdn._fla_bounds(lambda x, cu_seqlens=None: x, segs, bounds, "cpu")
    assert gdn._fla_bounds(fla_fn, segs, bounds, "meta")["cu_seqlens"].device.type == "meta"


def test_fla_chunk_indices_are_built_on_the_host():
    """A packed row hands fla its chunk indices (fla's own copy of them to the device blocks):
    one (segment, chunk) pair per started chunk, none for an empty segment; the same tensor for
    every layer of the forward; none for boundaries that are not the row's."""
    def fla_fn(x, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None):
        return x

    segs = Segments.from_host((0, 5, 12, 12, 13), torch.device("cpu"))
    bounds = Boundaries(text=segs)
    assert bounds.fla_chunks(torch.device("cpu"), 4).tolist() == [
        [0, 0], [0, 1], [1, 0], [1, 1], [3, 0]]
    assert bounds.fla_chunks(torch.device("cpu"), 64).tolist() == [[0, 0], [1, 0], [3, 0]]
    first = gdn._fla_bounds(fla_fn, segs, bounds, "cpu", 64)
    assert first["chunk_indices"].tolist() == [[0, 0], [1, 0], [3, 0]]
    assert gdn._fla_bounds(fla_fn, segs, bounds, "cpu", 64)["chunk_indices"] is first["chunk_indices"]
    assert first["chunk_indices"].dtype == torch.long
    # fla's chunk size unknown (fla absent, or its conv and delta rule disagree): fla builds them
    assert "chunk_indices" not in gdn._fla_bounds(fla_fn, segs, bounds, "cpu", None)
    chunks = Segments.from_host((0, 70), torch.device("cpu"))  # a context-parallel chunk's own
    assert "chunk_indices" not in gdn._fla_bounds(fla_fn, chunks, bounds, "cpu", 64)


def test_gdn_seam_leaves_transformers_untouched():
    """Building a packed Qwen3.5 changes the classes of its own GDN modules only: the modeling
    module's functions stay transformers' own, and a stock GDN module built afterwards keeps
    the stock class and forward."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    before = (m.causal_conv1d_fn, m.torch_chunk_gated_delta_rule, m.Qwen3_5GatedDeltaNet.forward)
    model, _ = build_model("tiny-qwen3_5", device="cpu")
    assert (m.causal_conv1d_fn, m.torch_chunk_gated_delta_rule,
            m.Qwen3_5GatedDeltaNet.forward) == before
    layers = [x for x in model.modules() if isinstance(x, m.Qwen3_5GatedDeltaNet)]
    assert layers and all(isinstance(x, gdn.GatedDeltaNet) for x in layers)
    stock = m.Qwen3_5GatedDeltaNet(model.config.text_config, 0)
    assert type(stock) is m.Qwen3_5GatedDeltaNet


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


@pytest.mark.parametrize("method", ["plain", "chunked"])
def test_loss_with_the_host_label_count(method):
    """Given the label count from the host, the loss picks the same rows as without it (the
    literal sum of per-token CE), and a count that does not match the labels is refused."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 8, generator=g)
    head = torch.nn.Linear(8, 11, bias=False)
    labels = torch.tensor([3, -100, 5, 0, -100, -100, 10, 1, -100])
    keep = labels != -100
    want = F.cross_entropy(head(h[keep]), labels[keep], reduction="sum")
    got, n = linear_ce_sum(h, head, labels, method=method, num_label_tokens=5)
    assert n == 5 and torch.allclose(got, want, atol=1e-5)
    with pytest.raises(RuntimeError, match="num_label_tokens does not match"):
        linear_ce_sum(h, head, labels, method=method, num_label_tokens=4)


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


def test_seams_are_installed_by_class_and_survive_copy_and_pickle():
    """Each family's seam classes become vlpack's subclasses (the config untouched); a deep
    copy and a pickled model keep them, and a second install changes nothing."""
    from vlpack.model import seams

    model, _ = build_model("tiny-qwen3_vl", device="cpu")
    kinds = {type(m).__name__ for m in model.modules() if type(m).__module__ == seams.__name__}
    assert kinds == {"PackedQwen3VLVisionAttention", "PackedQwen3VLVisionModel",
                     "PackedQwen3VLTextModel", "PackedQwen3VLModel"}
    assert "vlpack" not in model.config.to_json_string()
    assert seams.install(model, "qwen3_vl") == {"vision_attention": 2, "vision_tower": 1,
                                                "image_features": 1, "deepstack": 1}
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert {type(m).__name__ for m in twin.modules()} >= kinds


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                  "qwen3_5_moe"])
def test_family_registry_names_real_classes(name):
    """Every class the registry names exists in the installed transformers, and data and model
    agree on the family's sizes and token ids."""
    import importlib

    import transformers

    from vlpack.families import family

    f = family(name)
    assert getattr(transformers, f.hf_class)
    mod = importlib.import_module(f.modeling_module)
    for cls in (f.vision_attention, f.vision_tower, f.deepstack_text_model, f.gated_deltanet,
                f.model_class):
        assert cls is None or isinstance(getattr(mod, cls), type), cls
    spec = family(name)
    assert spec.image_pad_id == f.ids["image_token_id"] and spec.patch_size == f.patch_size
    assert spec.vision_start_id == f.ids["vision_start_token_id"]
    with pytest.raises(ValueError, match="not supported: vlpack runs qwen2_vl"):
        family("llava")


# --- fla's Hopper backward self-test ----------------------------------------------------------
def _stand_in_fla(monkeypatch, leaky: bool):
    """fla's varlen delta rule replaced by transformers' torch kernel (per segment, or across
    the boundaries when `leaky`), and vlpack's fla backend by a plain class."""
    import sys
    import types

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from vlpack.model import fla_hopper
    from vlpack.model.torch_kernels import torch_function

    raw = torch_function(m.Qwen3_5GatedDeltaNet, "torch_chunk_gated_delta_rule")

    def stand_in(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens):
        host = [0, q.shape[1]] if leaky else cu_seqlens.tolist()
        return torch.cat([raw(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
                          for s, e in itertools.pairwise(host)], dim=1), None

    ops = types.ModuleType("fla.ops.gated_delta_rule")
    ops.chunk_gated_delta_rule = stand_in
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", ops)

    class Backend:
        approved: typing.ClassVar[dict] = {}

    monkeypatch.setattr(fla_hopper, "_register", lambda: Backend)
    monkeypatch.setattr(fla_hopper, "fla_tiling", lambda K, V, index: (16, 16))
    return raw, Backend


def test_fla_self_test_inside_a_checkpointed_layer(monkeypatch):
    """The self-test runs in the first forward of a GDN layer, which activation checkpointing
    wraps: it runs once, and neither it nor the layer's backward trips the checkpoint."""
    from vlpack.model import fla_hopper

    raw, _ = _stand_in_fla(monkeypatch, leaky=False)
    calls = []

    def layer(x):
        calls.append(fla_hopper.self_test(16, 16, torch.device("cpu"), raw))
        return (x * 2).sin()

    x = torch.randn(4, 3, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    assert len(calls) == 1 and calls[0].ok, calls
    y.sum().backward()  # the layer is recomputed here (a second self-test, as the first)
    assert x.grad is not None and len(calls) == 2


@pytest.mark.parametrize("heads", [2, 5])
@pytest.mark.parametrize("leaky", [False, True])
def test_fla_self_test_approves_a_correct_kernel_and_refuses_a_leaky_one(monkeypatch, leaky, heads):
    """The self-test's judgement, on CPU with a stand-in for fla's kernel: one that restarts at
    the boundaries (the per-segment torch kernel) is approved; one that carries state across
    them is refused, with its errors, and leaves no approval behind. The row has the layer's
    head count (`heads`)."""
    from vlpack.model import fla_hopper

    raw, Backend = _stand_in_fla(monkeypatch, leaky)
    seen = []

    def counting(q, *args, **kwargs):
        seen.append(q.shape[2])
        return raw(q, *args, **kwargs)

    d = fla_hopper.self_test(16, 16, torch.device("cpu"), counting, heads=heads)
    assert seen and set(seen) == {heads}
    assert set(d.errors) == {"q", "k", "v", "g", "beta"}
    assert d.ok is not leaky, d.describe()
    assert (Backend.approved == {}) is leaky
    assert ("refused" in d.reason) is leaky


# --- routed experts under autocast --------------------------------------------------------------
def test_experts_under_autocast_meet_the_bf16_rule():
    """vlpack's experts (bf16 grouped GEMMs under autocast, fp32 weights) against transformers'
    per-expert loop: in fp32 (the truth) and in bf16 weights (the plain bf16 error); outputs and
    gradients within 2× the plain error. Outside autocast they are transformers' grouped_mm,
    bitwise; the stock model keeps transformers' implementation."""
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
    assert torch.equal(ex(x, idx, w), grouped_mm_experts_forward(ex, x, idx, w))

    def run(module, dtype, autocast):
        m = copy.deepcopy(module).to(dtype)
        m.config._experts_implementation = "eager" if not autocast else "vlpack_grouped_mm"
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
