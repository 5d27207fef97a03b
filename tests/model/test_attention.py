"""Varlen attention for packed rows (model/attention.py): the backends against masked SDPA,
the boundary guards, grouped heads, stock vision calls, and one dtype under autocast."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import make_sample
from vlpack.data.batch import build_thd_batch
from vlpack.model import attention, build_model
from vlpack.model.bounds import Boundaries, Segments
from vlpack.model.forward import packed_forward


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

    attention.register()  # as build_model does: the test must not rely on an earlier one's model
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


# --- under bf16 autocast -----------------------------------------------------------------------------
# Under bf16 autocast with fp32 master weights (the trainer's GPU setting) the attention kernels must
# receive one half-precision dtype, or they fall back to the slow per-segment loop.
def test_kernels_see_one_autocast_dtype(monkeypatch) -> None:
    model, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    seen = []
    original = attention.attend

    def spy(name, q, k, v, segs, **kw):
        seen.append((kw["stream"], q.dtype, k.dtype, v.dtype))
        return original(name, q, k, v, segs, **kw)

    monkeypatch.setattr(attention, "attend", spy)
    rng = np.random.default_rng(0)
    samples = [make_sample(f"s{i}", rng, patch_dim=spec.patch_dim) for i in range(2)]
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id,
            pad_to_multiple_of=1, mrope_after_video="transformers")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed_forward(model, batch, spec=spec)
    assert {s for s, *_ in seen} == {"text", "vision"}
    assert all(q == k == v == torch.bfloat16 for _, q, k, v in seen), seen
