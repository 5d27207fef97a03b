"""Varlen attention for packed THD rows, registered through transformers' AttentionInterface.

Boundaries come ONLY from the cu_seqlens the batch provides: the text model receives
`cu_seq_lens_q/k` and `max_length_q/k` as keyword arguments of the model call and transformers
forwards them to every attention call; the vision tower passes its own per-image `cu_seqlens`.
Positions are never used to infer boundaries.

Registered names (none contains "flash", which would trigger transformers' flash-attn path):
  vlpack_varlen  — GPU: torch.nn.attention.varlen.varlen_attn, else flash-attn's
                   flash_attn_varlen_func; CPU (and fp32): per-segment SDPA reference.
  vlpack_flex    — FlexAttention with a document block mask.

Vision towers: stock transformers calls attention once per image unless flash attention is
requested. `install_vision_varlen(model)` wraps the forward of each vision attention module so
that (a) the text cu kwargs, which transformers 5.17 also hands to the vision tower, are dropped,
and (b) the module takes its varlen branch: one call per layer over all images of the bin. The
module's `config` becomes a view of its config marked `vlpack_vision_varlen`, which the patched
`is_flash_attention_requested` and the attention function read: plain attribute reads, which
torch.compile traces (a compiled vision block keeps its attention module in the graph).

Legend: B = batch (1 for packed rows), H = query heads, K = key/value heads, T = tokens,
D = head dim, S = segments.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import inspect
import itertools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlpack.model.bounds import host_bounds, max_segment

logger = logging.getLogger(__name__)

VARLEN = "vlpack_varlen"
FLEX = "vlpack_flex"
NAMES = (VARLEN, FLEX)
BACKENDS = ("auto", "sdpa", "varlen", "flex")
TEXT_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_FAMILY_MODULES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")

# Kernel path taken per stream ("text" / "vision"), for `vlpack check` and the logs.
PATHS_USED: dict[str, str] = {}
_WARNED: set[str] = set()


def _say_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(msg)


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


@functools.cache
def _torch_varlen_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's varlen_attn takes fewer k/v heads than query heads (FlashAttention
    does natively): probed once per device and dtype on a tiny causal call, forward and
    backward, against the same call with the k/v heads repeated.

    The probe runs in a thread of its own: the first attention call may sit inside activation
    checkpointing, whose saved-tensor hooks (thread-local, as are autocast and grad mode) would
    take the probe's tensors for the layer's; the recomputation, finding the answer cached,
    saves fewer, and backward stops with a CheckpointError (the 8B recipe on 2 H200s). The first
    call for a device and dtype is always a forward (a recomputation finds the answer cached):
    called from autograd's own backward thread, the probe's backward would wait on it."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_probe_varlen_gqa, device, dtype).result()


def _probe_varlen_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # a new thread starts on device 0
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(8, h, 64, device=device, generator=g, dtype=dtype)
               for h in (4, 2, 2))
    dout = torch.randn(8, 4, 64, device=device, generator=g, dtype=dtype)
    cu = torch.tensor([0, 3, 8], device=device, dtype=torch.int32)
    runs = []
    with torch.inference_mode(False), torch.enable_grad():
        for repeat in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            try:
                out = _torch_varlen_call(*leaves, cu, 5, True, 0.125, repeat=repeat)
                out.backward(dout)
            except (RuntimeError, ValueError):
                return False
            runs.append([out.detach()] + [t.grad for t in leaves])
    native, repeated = runs
    return torch.equal(native[0], repeated[0]) and all(
        torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        for a, b in zip(native[1:], repeated[1:], strict=True))


def _torch_varlen_call(q_THD, k_TKD, v_TKD, cu_S1, max_len, causal, scale, *, repeat: bool):
    """torch's varlen_attn; with `repeat` the k/v heads are first repeated to the query heads."""
    fn, params = _torch_varlen()
    k, v = _repeat_kv(q_THD, k_TKD, v_TKD) if repeat else (k_TKD, v_TKD)
    kw = {}
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


def _run_kernel(name: str, stream: str, q_THD, k_TKD, v_TKD, cu_S1, max_len, causal, scale,
                bounds: tuple[int, ...]):
    if name == FLEX:
        PATHS_USED[stream] = "flex_attention (document mask)"
        return _flex_call(q_THD, k_TKD, v_TKD, cu_S1, causal, scale)
    half = q_THD.dtype in (torch.float16, torch.bfloat16)
    if q_THD.is_cuda and half:
        if _torch_varlen() is not None:
            grouped = q_THD.shape[1] != k_TKD.shape[1]
            gqa = grouped and _torch_varlen_gqa(q_THD.device, q_THD.dtype)
            PATHS_USED[stream] = "torch varlen_attn" + " (native GQA)" * gqa
            return _torch_varlen_call(q_THD, k_TKD, v_TKD, cu_S1, max_len, causal, scale,
                                      repeat=grouped and not gqa)
        if _flash_attn() is not None:
            PATHS_USED[stream] = "flash_attn_varlen_func"
            return _flash_attn()(q_THD, k_TKD, v_TKD, cu_S1, cu_S1, max_len, max_len,
                                 softmax_scale=scale, causal=causal)
        _say_once("novarlen", "vlpack: neither torch varlen_attn nor flash-attn is available; "
                  "attention runs per segment with SDPA (correct, slower)")
    PATHS_USED[stream] = "per-segment SDPA"
    return _sdpa_segments(q_THD, k_TKD, v_TKD, list(bounds), causal, scale)


# --- the AttentionInterface function ------------------------------------------------------------
def _segments(module: nn.Module, T: int, kwargs: dict) -> tuple[bool, torch.Tensor | None]:
    """Causality and boundaries of one call, with the guards against foreign cu kwargs."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    cu = kwargs.get("cu_seq_lens_q")
    if not causal and not _vision_varlen(getattr(module, "config", None)):
        # A bidirectional (vision) call outside vlpack's vision wrapper is stock transformers'
        # one-image-per-call path; any cu kwargs here are the TEXT ones (transformers 5.17).
        return False, None
    if cu is not None:
        if kwargs.get("cu_seq_lens_k") is not None and kwargs["cu_seq_lens_k"] is not cu:
            if not torch.equal(kwargs["cu_seq_lens_k"], cu):
                raise ValueError("vlpack attention needs cu_seq_lens_k == cu_seq_lens_q "
                                 "(self-attention over one packed row)")
        if host_bounds(cu)[-1] != T:
            raise ValueError(
                f"cu_seq_lens_q ends at {host_bounds(cu)[-1]} but the call has {T} tokens: pass the "
                "batch's cu_seqlens_padded (covering the whole row, padding included)"
            )
    return causal, cu


def _autocast_qkv(q, k, v):
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
    query, key, value = _autocast_qkv(query, key, value)
    causal, cu = _segments(module, T, kwargs)
    stream = "text" if causal else "vision"
    if B != 1:
        if cu is not None or attention_mask is not None:
            raise ValueError("vlpack attention runs packed rows (batch 1, no 2-D mask); use "
                             "attn_implementation='sdpa' for padded batches")
    if cu is None:  # one sequence per row (an unpacked sample or one image)
        bounds = (0, T)
        cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    else:
        bounds = host_bounds(cu)  # one device sync per cu tensor and forward, not per layer
        cu = cu.to(device=query.device, dtype=torch.int32)
    max_len = kwargs.get("max_length_q") or max_segment(bounds)
    outs = []
    for b in range(B):
        q, k, v = (t[b].transpose(0, 1) for t in (query, key, value))
        outs.append(_run_kernel(name, stream, q, k, v, cu, int(max_len), causal, scale, bounds))
    return torch.stack(outs, dim=0), None


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           **kwargs):
    """AttentionInterface entry for FlexAttention with a document mask."""
    return varlen_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                    _vlpack_name=FLEX, **kwargs)


# --- vision towers: one varlen call per layer, text kwargs dropped -------------------------------
class VisionVarlenConfig:
    """A vision attention module's view of its config, marked as switched to vlpack's varlen
    branch. A view, not a copy: reads and writes reach the model's own config, which is neither
    changed nor saved with the mark."""

    vlpack_vision_varlen = True

    def __init__(self, config: object) -> None:
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> object:
        # Dunders and `_config` itself are the view's own: copy and pickle look them up on a
        # view whose `_config` is not set yet, which would otherwise recurse here.
        if name == "_config" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._config, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._config, name, value)


def _vision_varlen(config) -> bool:
    """Whether a call under `config` is a wrapped vision attention on one of vlpack's backends."""
    return (getattr(config, "vlpack_vision_varlen", False)
            and getattr(config, "_attn_implementation", None) in NAMES)


def _patched_is_flash(original: Callable) -> Callable:
    @functools.wraps(original)
    def is_flash_attention_requested(config=None, requested_attention_implementation=None,
                                     version=None):
        # Only for vlpack's wrapped vision attention modules (and only on vlpack's own
        # backends): take the module's varlen branch, which passes the per-image cu_seqlens in
        # one call.
        if version is None and _vision_varlen(config):
            return True
        return original(config=config,
                        requested_attention_implementation=requested_attention_implementation,
                        version=version)

    is_flash_attention_requested._vlpack = True
    return is_flash_attention_requested


@functools.cache
def _patch_family_modules() -> None:
    for fam in _FAMILY_MODULES:
        try:
            mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
        except ImportError:
            continue
        fn = getattr(mod, "is_flash_attention_requested", None)
        if fn is not None and not getattr(fn, "_vlpack", False):
            mod.is_flash_attention_requested = _patched_is_flash(fn)


def _vision_forward(self: nn.Module, *args, **kwargs):
    for k in TEXT_VARLEN_KWARGS:  # transformers 5.17 hands the text boundaries to the ViT too
        kwargs.pop(k, None)
    return type(self).forward(self, *args, **kwargs)


def is_vision_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("VisionAttention")


def install_vision_varlen(model: nn.Module) -> int:
    """Wrap the forward of every vision attention module of `model`; returns how many."""
    _patch_family_modules()
    n = 0
    for m in model.modules():
        if is_vision_attention(m) and "forward" not in m.__dict__:
            m.forward = _vision_forward.__get__(m)
            m.config = VisionVarlenConfig(m.config)
            n += 1
    return n


def register() -> None:
    """Register vlpack's attention functions with transformers (idempotent)."""
    from transformers import AttentionInterface

    # Never traced: inside a compiled decoder layer (model.compile_scope=layers) the call is a
    # graph break, and the kernel choice, host bounds and GQA probe run as in eager mode.
    AttentionInterface.register(VARLEN, torch.compiler.disable(varlen_attention_forward))
    AttentionInterface.register(FLEX, torch.compiler.disable(flex_attention_forward))


register()
