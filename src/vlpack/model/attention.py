"""Varlen attention for packed THD rows, registered through transformers' AttentionInterface.

Boundaries come ONLY from the batch: the text model's attention calls receive the forward's
`Boundaries` (`vlpack_bounds`, see bounds.py) among their keyword arguments, as transformers
forwards the model call's kwargs to every attention call; the vision attention (vision.py) calls
`attend` with the tower's per-image segments. Positions are never used to infer boundaries.

A stock call (no Boundaries, no cu_seq_lens: a padded batch, `generate` with its cache) runs
transformers' own SDPA function with the mask transformers would build for it
(`stock_attention`). transformers builds no mask for a registered name without a mask function
and passes `attention_mask=None`, so the base model's forward hands the call's 2-D mask to the
attention calls as `vlpack_padding` (`StockMask`, installed by class, seams.py).

Registered names (none contains "flash", which would trigger transformers' flash-attn path):
  vlpack_varlen  — GPU: torch.nn.attention.varlen.varlen_attn, else flash-attn's
                   flash_attn_varlen_func; CPU (and fp32): per-segment SDPA reference.
  vlpack_flex    — FlexAttention with a document block mask.

Legend: B = batch (1 for packed rows), H = query heads, K = key/value heads, T = tokens,
D = head dim, S = segments.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlpack.model.bounds import BOUNDS_KWARG, Segments

VARLEN = "vlpack_varlen"
FLEX = "vlpack_flex"
NAMES = (VARLEN, FLEX)
BACKENDS = ("auto", "sdpa", "varlen", "flex")
TEXT_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PADDING_KWARG = "vlpack_padding"
"""The keyword that carries a stock call's 2-D attention mask [B, M] to the attention calls."""


def resolve_backend(backend: str, device: torch.device | str | None) -> str:
    """The attn_implementation name for a `--backend` choice ("sdpa" is stock transformers)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "sdpa":
        return "sdpa"
    if backend == "flex":
        return FLEX
    return VARLEN


# --- kernels: q/k/v are [T, H|K, D]; every kernel returns [T, H, D] -------------------------------
def _sdpa_segments(q_THD, k_TKD, v_TKD, cu_S1: list[int], causal: bool, scale: float):
    """Reference: one SDPA call per segment (exact, any device and dtype)."""
    outs = []
    gqa = q_THD.shape[1] != k_TKD.shape[1]
    for s, e in itertools.pairwise(cu_S1):
        q, k, v = (t[s:e].transpose(0, 1) for t in (q_THD, k_TKD, v_TKD))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


def _repeat_kv(q_THD, k_TKD, v_TKD):
    rep = q_THD.shape[1] // k_TKD.shape[1]
    if rep == 1:
        return k_TKD, v_TKD
    return k_TKD.repeat_interleave(rep, dim=1), v_TKD.repeat_interleave(rep, dim=1)


@functools.cache
def _torch_varlen() -> tuple[Callable, frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


NATIVE_GQA_TORCH = ("2.11",)
"""torch releases whose varlen_attn, without an `enable_gqa` parameter, takes fewer k/v heads
than query heads as they are (the FlashAttention kernel behind it groups them):
tests/gpu/test_gpu_model.py::test_kernel_flash_attention_rule holds on an H200 with torch 2.11."""


def torch_varlen_native_gqa() -> bool:
    """Whether this torch's varlen_attn takes grouped k/v heads unrepeated: its signature has
    `enable_gqa`, or its release is one of NATIVE_GQA_TORCH. Otherwise the k/v heads are
    repeated to the query heads first."""
    fn = _torch_varlen()
    if fn is None:
        return False
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return "enable_gqa" in fn[1] or release in NATIVE_GQA_TORCH


def _torch_varlen_call(q_THD, k_TKD, v_TKD, cu_S1, max_len, causal, scale):
    """torch's varlen_attn, grouped k/v heads passed as they are where it takes them."""
    fn, params = _torch_varlen()
    grouped = q_THD.shape[1] != k_TKD.shape[1]
    kw = {}
    k, v = k_TKD, v_TKD
    if grouped and "enable_gqa" in params:
        kw["enable_gqa"] = True
    elif grouped and not torch_varlen_native_gqa():
        k, v = _repeat_kv(q_THD, k_TKD, v_TKD)
    if "scale" in params:
        kw["scale"] = scale
    if "window_size" in params:  # torch >= 2.10: causal is the window (-1, 0)
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kw["is_causal"] = causal
    elif causal is False:
        raise ValueError("this torch's varlen_attn cannot run bidirectional attention")
    out = fn(q_THD.contiguous(), k.contiguous(), v.contiguous(), cu_S1, cu_S1, max_len, max_len,
             **kw)
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def _flash_attn() -> Callable | None:
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:
        return None


def _flex_call(q_THD, k_TKD, v_TKD, cu_S1, causal, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = q_THD.shape[0]
    doc_T = torch.repeat_interleave(
        torch.arange(len(cu_S1) - 1, device=q_THD.device), torch.diff(cu_S1).long(),
        output_size=T,
    )

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_T[q_idx] == doc_T[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    block_mask = create_block_mask(mask_mod, None, None, T, T, device=q_THD.device)
    fn = _compiled_flex() if q_THD.is_cuda else flex_attention
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q_THD, k_TKD, v_TKD))
    out = fn(q, k, v, block_mask=block_mask, scale=scale,
             enable_gqa=q_THD.shape[1] != k_TKD.shape[1])
    return out[0].transpose(0, 1)


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attend(name: str, q_THD, k_TKD, v_TKD, segs: Segments, *, causal: bool, scale: float,
           paths: dict[str, str], stream: str):
    """Attention of q/k/v [T, H|K, D] within each segment of `segs` → [T, H, D], with the
    kernel of backend `name`; the kernel's name lands in `paths[stream]`."""
    cu_S1, max_len = segs.cu.to(q_THD.device), segs.max_len
    if name == FLEX:
        paths[stream] = "flex_attention (document mask)"
        return _flex_call(q_THD, k_TKD, v_TKD, cu_S1, causal, scale)
    half = q_THD.dtype in (torch.float16, torch.bfloat16)
    if q_THD.is_cuda and half:
        if _torch_varlen() is not None:
            gqa = q_THD.shape[1] != k_TKD.shape[1] and torch_varlen_native_gqa()
            paths[stream] = "torch varlen_attn" + " (native GQA)" * gqa
            return _torch_varlen_call(q_THD, k_TKD, v_TKD, cu_S1, max_len, causal, scale)
        if _flash_attn() is not None:
            paths[stream] = "flash_attn_varlen_func"
            return _flash_attn()(q_THD, k_TKD, v_TKD, cu_S1, cu_S1, max_len, max_len,
                                 softmax_scale=scale, causal=causal)
        warnings.warn("vlpack: neither torch varlen_attn nor flash-attn is available; attention "
                      "runs per segment with SDPA (correct, slower)", stacklevel=2)
    paths[stream] = "per-segment SDPA"
    return _sdpa_segments(q_THD, k_TKD, v_TKD, list(segs.host), causal, scale)


def _sdpa_chunks(q_QHD, k_KKD, v_KKD, cu_q: tuple[int, ...], cu_k: tuple[int, ...], scale: float):
    """Reference for query chunks against their own key ranges: one SDPA call per chunk with
    an explicit causal mask aligned to the chunk's last key (query i of a chunk of Lq queries
    over Lk keys sees keys 0 .. Lk − Lq + i)."""
    outs = []
    gqa = q_QHD.shape[1] != k_KKD.shape[1]
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        lq, lk = qe - qs, ke - ks
        mask = (torch.arange(lk, device=q_QHD.device)[None, :]
                <= torch.arange(lq, device=q_QHD.device)[:, None] + (lk - lq))
        q, k, v = (t.transpose(0, 1) for t in (q_QHD[qs:qe], k_KKD[ks:ke], v_KKD[ks:ke]))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


def attend_chunks(name: str, q_QHD, k_KKD, v_KKD, chunks_q: Segments, chunks_k: Segments, *,
                  scale: float, paths: dict[str, str]):
    """Causal attention of query chunks (`chunks_q` boundaries over q) against their key ranges
    (`chunks_k` over k/v), each chunk's queries being the last of its keys (context parallelism:
    context.py). The kernels align the causal diagonal to the last key, as flash attention does
    when a chunk has more keys than queries."""
    if name == FLEX:
        raise ValueError("model.backend=flex does not run context parallelism; use "
                         "model.backend=varlen (or auto)")
    half = q_QHD.dtype in (torch.float16, torch.bfloat16)
    if q_QHD.is_cuda and half:
        cq, ck = chunks_q.cu.to(q_QHD.device), chunks_k.cu.to(q_QHD.device)
        if _torch_varlen() is not None:
            fn, params = _torch_varlen()
            k, v = k_KKD, v_KKD
            kw = {}
            if q_QHD.shape[1] != k_KKD.shape[1]:
                if "enable_gqa" in params:
                    kw["enable_gqa"] = True
                elif not torch_varlen_native_gqa():
                    k, v = _repeat_kv(q_QHD, k_KKD, v_KKD)
            if "scale" in params:
                kw["scale"] = scale
            if "window_size" in params:  # torch >= 2.10: causal is the window (-1, 0)
                kw["window_size"] = (-1, 0)
            elif "is_causal" in params:
                kw["is_causal"] = True
            else:
                raise ValueError("this torch's varlen_attn takes neither window_size nor "
                                 "is_causal: upgrade torch for context parallelism")
            paths["text"] = "torch varlen_attn, query chunks against gathered keys"
            out = fn(q_QHD.contiguous(), k.contiguous(), v.contiguous(), cq, ck,
                     chunks_q.max_len, chunks_k.max_len, **kw)
            return out[0] if isinstance(out, tuple) else out
        if _flash_attn() is not None:
            paths["text"] = "flash_attn_varlen_func, query chunks against gathered keys"
            return _flash_attn()(q_QHD, k_KKD, v_KKD, cq, ck, chunks_q.max_len, chunks_k.max_len,
                                 softmax_scale=scale, causal=True)
    paths["text"] = "per-chunk SDPA against gathered keys"
    return _sdpa_chunks(q_QHD, k_KKD, v_KKD, chunks_q.host, chunks_k.host, scale)


# --- the AttentionInterface function ------------------------------------------------------------
def _is_causal(module: nn.Module, kwargs: dict) -> bool:
    causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if causal is None else bool(causal)


def _segments(module: nn.Module, T: int, kwargs: dict) -> tuple[bool, Segments]:
    """Causality and boundaries of one call: the forward's Boundaries for the text model, one
    sequence otherwise (an unpacked sample, or one image of stock transformers' per-image vision
    path)."""
    causal = _is_causal(module, kwargs)
    bounds = kwargs.get(BOUNDS_KWARG)
    if causal and bounds is not None and bounds.text is not None:
        segs = bounds.text
        if segs.host[-1] != T:
            raise ValueError(
                f"the packed row's boundaries end at {segs.host[-1]} but the attention call has "
                f"{T} tokens: pass the batch's cu_seqlens_padded (covering the whole row)")
        return True, segs
    cu = kwargs.get("cu_seq_lens_q") if causal else None
    if cu is not None:  # boundaries given without vlpack's Boundaries: one read from the device
        if kwargs.get("cu_seq_lens_k") is not None and not torch.equal(kwargs["cu_seq_lens_k"], cu):
            raise ValueError("vlpack attention needs cu_seq_lens_k == cu_seq_lens_q "
                             "(self-attention over one packed row)")
        host = tuple(int(x) for x in cu.tolist())
        if host[-1] != T:
            raise ValueError(f"cu_seq_lens_q ends at {host[-1]} but the call has {T} tokens: pass "
                             "the batch's cu_seqlens_padded (covering the whole row)")
        return causal, Segments(cu.to(torch.int32), host, max(b - a for a, b in
                                                             itertools.pairwise(host)))
    return causal, Segments(torch.tensor((0, T), dtype=torch.int32), (0, T), T)


def autocast_qkv(q, k, v):
    """Cast q/k/v as SDPA is cast under autocast. Under bf16 autocast with fp32 master weights,
    the rotary embedding returns fp32 q/k beside a bf16 v; without this cast the call would miss
    the half-precision varlen kernels and fall back to the per-segment loop."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention got mixed dtypes q={q.dtype} k={k.dtype} v={v.dtype} "
                         "outside autocast: run the model in one dtype or under torch.autocast")
    return q, k, v


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: query [B, H, T, D], key/value [B, K, T, D] → ([B, T, H, D], None)."""
    name = kwargs.pop("_vlpack_name", VARLEN)
    if dropout:
        raise ValueError("vlpack attention does not implement attention dropout; set it to 0")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("vlpack attention does not implement sliding windows; "
                         "set use_sliding_window=False")
    B, _, T, D = query.shape
    scale = D**-0.5 if scaling is None else scaling
    query, key, value = autocast_qkv(query, key, value)
    bounds = kwargs.get(BOUNDS_KWARG)
    split = bounds.context if bounds is not None else None
    if split is not None and _is_causal(module, kwargs):
        return _context_attention(name, query, key, value, split, scale, bounds.paths), None
    packed = (bounds is not None and bounds.text is not None) or \
        kwargs.get("cu_seq_lens_q") is not None
    padding = kwargs.get(PADDING_KWARG)
    if not packed and _is_causal(module, kwargs) and (padding is not None or key.shape[2] != T):
        return stock_attention(module, query, key, value, padding, scale), None
    causal, segs = _segments(module, T, kwargs)
    if B != 1 and (len(segs.host) > 2 or attention_mask is not None):
        raise ValueError("vlpack attention runs packed rows (batch 1, no 2-D mask); use "
                         "attn_implementation='sdpa' for padded batches")
    paths = bounds.paths if bounds is not None else {}
    stream = "text" if causal else "vision"
    outs = []
    for b in range(B):
        q, k, v = (t[b].transpose(0, 1) for t in (query, key, value))
        outs.append(attend(name, q, k, v, segs, causal=causal, scale=scale, paths=paths,
                           stream=stream))
    return torch.stack(outs, dim=0), None


def stock_attention(module: nn.Module, query, key, value, padding_BM: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """A stock call's causal attention, as transformers runs it under `sdpa`: query [B, H, Q, D]
    against key/value [B, K, S, D] (S > Q with a cache) → [B, Q, H, D]. `padding_BM` is the
    call's 2-D mask over the tokens seen so far (M ≥ Q; M < S with a static cache, whose slots
    past M are empty): query i sits at position M − Q + i and sees the unpadded keys up to it.
    Without a mask, the keys are the past S − Q tokens and the query's own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    Q, S = query.shape[2], key.shape[2]
    seen = S if padding_BM is None else padding_BM.shape[-1]
    if not Q <= seen <= S:
        raise ValueError(f"the attention mask covers {seen} tokens but the call has {Q} queries "
                         f"and {S} keys: pass a 2-D attention_mask over the cached and new tokens")
    dev = query.device
    mask = (torch.arange(S, device=dev)[None, :]
            <= torch.arange(Q, device=dev)[:, None] + (seen - Q))[None, None]
    if padding_BM is not None:
        keep_BS = F.pad(padding_BM.to(dev, torch.bool), (0, S - seen), value=False)
        mask = mask & keep_BS[:, None, None, :]
    out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scale,
                                    is_causal=True)
    return out


class StockMask(nn.Module):
    """Mixin for a base model class: a stock call's 2-D attention mask handed to the text
    attention (`PADDING_KWARG`), which transformers never passes to a registered function that
    has no mask function. A packed forward (with Boundaries) is left as it is."""

    def forward(self, *args, **kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if kwargs.get(BOUNDS_KWARG) is None and isinstance(mask, torch.Tensor) and mask.ndim == 2:
            kwargs[PADDING_KWARG] = mask
        return super().forward(*args, **kwargs)


def _context_attention(name, query, key, value, split, scale, paths):
    """This rank's queries [1, H, R, D] against the keys and values of every rank (context.py)."""
    if query.shape[0] != 1 or query.shape[2] != split.num_local:
        raise ValueError(f"context-parallel attention got {query.shape[2]} tokens but this rank "
                         f"holds {split.num_local} of the row: run packed rows (batch 1)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    # keys and values in one collective
    k, v = split.gather_keys(torch.cat([k, v], dim=-1)).split([k.shape[-1], v.shape[-1]], -1)
    out = attend_chunks(name, q, k, v, split.chunks_q, split.chunks_k, scale=scale, paths=paths)
    return out[None]


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           **kwargs):
    """AttentionInterface entry for FlexAttention with a document mask."""
    return varlen_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                    _vlpack_name=FLEX, **kwargs)


def register() -> None:
    """Register vlpack's attention functions with transformers (idempotent)."""
    from transformers import AttentionInterface

    # Never traced: inside a compiled decoder layer (model.compile_scope=layers) the call is a
    # graph break, and the kernel choice and host bounds run as in eager mode.
    AttentionInterface.register(VARLEN, torch.compiler.disable(varlen_attention_forward))
    AttentionInterface.register(FLEX, torch.compiler.disable(flex_attention_forward))
