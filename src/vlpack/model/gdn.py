"""Boundary-aware Gated-DeltaNet (Qwen3.5 linear-attention layers) for packed rows.

transformers' GDN forward calls two module-level kernels: `causal_conv1d_fn` (the short causal
conv, which receives the text kwargs, `cu_seq_lens_q` among them) and
`torch_chunk_gated_delta_rule` (receives `cu_seqlens=cu_seq_lens_q`). Their torch fallbacks
cannot keep samples apart: the conv silently mixes neighbours across a boundary, the delta rule
raises. vlpack replaces both module attributes with dispatchers that are active only inside a
GDN module that `install_gdn(model)` wrapped, so stock models in the same process keep stock
behaviour. Inside, with boundaries given, both restart at every segment:
  GPU + fla importable → fla's `causal_conv1d` / `chunk_gated_delta_rule` with `cu_seqlens`;
  otherwise           → the torch reference run once per segment (exact, slower; said once).
Without boundaries the row is one sequence (an unpacked sample) and the stock kernels run.

fla 0.6.0 refuses the backward of its gated delta rule on Hopper with Triton 3.4-3.7.0 (wrong
results, fla #640) unless tilelang is installed; vlpack then runs the delta rule with the
per-segment torch reference when gradients are needed (the conv still uses fla), and says so.
`torch_reference()` makes even stock GDN modules use transformers' torch kernels (the reference
side of `vlpack check`, independent of optional kernels).

Legend: B = batch (1 when packed), C = conv channels, T = tokens, W = conv width,
Hk/Hv = key/value heads, Dk/Dv = head dims.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import itertools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlpack.model.bounds import derived, host_bounds

logger = logging.getLogger(__name__)

_GDN_MODULES = ("qwen3_5", "qwen3_5_moe")
_ACTIVE = contextvars.ContextVar("vlpack_gdn_active", default=False)
_TORCH_REFERENCE = contextvars.ContextVar("vlpack_gdn_torch_reference", default=False)
PATHS_USED: dict[str, str] = {}
_WARNED: set[str] = set()


def _say_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(msg)


@functools.cache
def _fla() -> tuple[Callable, Callable] | None:
    """fla's (causal_conv1d, chunk_gated_delta_rule), or None when fla cannot run here."""
    try:
        conv = importlib.import_module("fla.modules.causal_conv1d.ops").causal_conv1d
        gdr = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:
        return None
    return conv, gdr


_FLA_CU: dict = {}


def _fla_bounds(fn: Callable, cu: torch.Tensor, bounds: Sequence[int], device) -> dict:
    """The boundary kwargs of an fla call: `cu_seqlens` on the device and, where fla takes it,
    `cu_seqlens_cpu`, the host copy we already hold, so fla derives its chunk indices without
    reading the device tensor back. Every GDN layer of a forward gets the SAME two tensor
    objects: fla caches its index tensors by argument identity, so it builds (and copies to the
    device, one host sync) them once per forward instead of once per layer."""
    device = torch.device(device)
    cu_dev, cu_cpu = derived(
        _FLA_CU, cu, lambda: (cu.to(device, torch.long), torch.tensor(bounds, dtype=torch.long)),
        key=str(device))
    kw = {"cu_seqlens": cu_dev}
    if _takes_cu_seqlens_cpu(fn):
        kw["cu_seqlens_cpu"] = cu_cpu
    return kw


@functools.cache
def _takes_cu_seqlens_cpu(fn: Callable) -> bool:
    return "cu_seqlens_cpu" in inspect.signature(fn).parameters


@functools.cache
def fla_delta_rule_backward_ok() -> bool:
    """False where fla's gated-delta-rule backward refuses to run (Hopper + Triton < 3.7.1
    without tilelang, fla #640)."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except Exception:
        return True
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return True
    try:
        importlib.import_module("tilelang")
    except Exception:
        return False
    return True


@contextlib.contextmanager
def torch_reference():
    """Inside, GDN modules that vlpack did not wrap run transformers' torch kernels."""
    token = _TORCH_REFERENCE.set(True)
    try:
        yield
    finally:
        _TORCH_REFERENCE.reset(token)


def _stock(original: Callable) -> Callable:
    """The stock kernel, or its pure-torch fallback in `torch_reference()` mode."""
    if _TORCH_REFERENCE.get():
        return getattr(original, "__wrapped__", original)
    return original


def _use_fla(x: torch.Tensor) -> bool:
    """fla's kernels for half-precision inputs on CUDA. float32 inputs run the exact per-segment
    torch path: fla's Triton kernels multiply in TF32 there (its fp32 delta-rule forward is 3e-4
    off the torch reference in the tiny Qwen3.5's logits on an H200), and float32 is what
    `vlpack check` proves the boundary contract in."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if _fla() is None:
        _say_once("nofla", "vlpack: fla is not importable; Gated-DeltaNet runs the per-segment "
                  "torch reference (correct, slower). Install fla-core + flash-linear-attention.")
        return False
    return True


def _bounds(cu: torch.Tensor, T: int) -> list[int]:
    cu_list = list(host_bounds(cu))
    if cu_list[0] != 0 or cu_list[-1] != T or any(b <= a for a, b in itertools.pairwise(cu_list)):
        raise ValueError(
            f"Gated-DeltaNet boundaries {cu_list} do not split a row of {T} tokens into "
            "non-empty segments: pass the batch's cu_seqlens_padded"
        )
    return cu_list


# --- short causal conv --------------------------------------------------------------------------
def segment_conv1d(x_BCT, weight_CW, bias_C, activation: str | None, cu: torch.Tensor):
    """Causal depthwise conv that restarts at every boundary in `cu` (B must be 1)."""
    from transformers.activations import ACT2FN

    B, C, T = x_BCT.shape
    if B != 1:
        raise ValueError("packed Gated-DeltaNet needs batch size 1 (one packed row)")
    bounds = _bounds(cu, T)
    if _use_fla(x_BCT):
        PATHS_USED["conv"] = "fla causal_conv1d (cu_seqlens)"
        conv = _fla()[0]
        y_BTC, _ = conv(x_BCT.transpose(1, 2).contiguous(), weight=weight_CW, bias=bias_C,
                        activation=activation, **_fla_bounds(conv, cu, bounds, x_BCT.device))
        return y_BTC.transpose(1, 2).to(x_BCT.dtype)
    PATHS_USED["conv"] = "per-segment torch conv1d"
    pad = weight_CW.shape[-1] - 1
    x = x_BCT.to(weight_CW.dtype)
    outs = [
        F.conv1d(x[:, :, s:e], weight_CW.unsqueeze(1), bias_C, padding=pad, groups=C)[:, :, : e - s]
        for s, e in itertools.pairwise(bounds)
    ]
    y = torch.cat(outs, dim=-1)
    if activation is not None:
        y = ACT2FN[activation](y)
    return y.to(x_BCT.dtype)


def _conv_dispatch(original: Callable) -> Callable:
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if not _ACTIVE.get() or cu is None:
            return _stock(original)(hidden_states, weight, bias, activation=activation, **kwargs)
        if kwargs.get("seq_idx") is not None:
            raise ValueError("pass boundaries as cu_seq_lens_q, not seq_idx")
        return segment_conv1d(hidden_states, weight, bias, activation, cu)

    causal_conv1d_fn._vlpack = True
    return causal_conv1d_fn


# --- gated delta rule ---------------------------------------------------------------------------
def _gdr_dispatch(original: Callable) -> Callable:
    torch_fn = getattr(original, "__wrapped__", None)

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        common = dict(initial_state=initial_state, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if not _ACTIVE.get() or cu_seqlens is None:
            return _stock(original)(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                                    cu_seqlens=cu_seqlens, **common, **kwargs)
        B, T = query.shape[:2]
        if B != 1:
            raise ValueError("packed Gated-DeltaNet needs batch size 1 (one packed row)")
        if initial_state is not None or output_final_state:
            raise ValueError("packed Gated-DeltaNet runs without a cache: call with "
                             "use_cache=False")
        bounds = _bounds(cu_seqlens, T)
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value, g, beta))
        if _use_fla(query) and needs_grad and not fla_delta_rule_backward_ok():
            _say_once("flabwd", "vlpack: fla's gated-delta-rule backward is disabled on this "
                      "GPU/Triton (Hopper + Triton < 3.7.1, fla #640; install tilelang or Triton "
                      ">= 3.7.1); the delta rule runs per segment in torch")
        elif _use_fla(query):
            PATHS_USED["delta_rule"] = "fla chunk_gated_delta_rule (cu_seqlens)"
            gdr = _fla()[1]
            out, _ = gdr(query, key, value, g=g, beta=beta,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         **_fla_bounds(gdr, cu_seqlens, bounds, query.device))
            return out, None
        if torch_fn is None:
            raise ValueError("cannot find transformers' torch gated-delta-rule to run per "
                             "segment; install fla (fla-core + flash-linear-attention)")
        PATHS_USED["delta_rule"] = "per-segment torch chunk_gated_delta_rule"
        outs = [
            torch_fn(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                     chunk_size=chunk_size, **common)[0]
            for s, e in itertools.pairwise(bounds)
        ]
        return torch.cat(outs, dim=1), None

    torch_chunk_gated_delta_rule._vlpack = True
    return torch_chunk_gated_delta_rule


@functools.cache
def _patch_modules() -> None:
    for fam in _GDN_MODULES:
        try:
            mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
        except ImportError:
            continue
        for attr, make in (("causal_conv1d_fn", _conv_dispatch),
                           ("torch_chunk_gated_delta_rule", _gdr_dispatch)):
            fn = getattr(mod, attr, None)
            if fn is None:
                raise ValueError(
                    f"transformers.models.{fam} has no {attr}: this transformers version's "
                    "Gated-DeltaNet is not supported by vlpack (tested: 5.17, 5.24)"
                )
            if not getattr(fn, "_vlpack", False):
                setattr(mod, attr, make(fn))


def _gdn_forward(self: nn.Module, *args, **kwargs):
    token = _ACTIVE.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)


def is_gdn(module: nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def install_gdn(model: nn.Module) -> int:
    """Make every Gated-DeltaNet module of `model` boundary-aware; returns how many."""
    n = 0
    for m in model.modules():
        if is_gdn(m):
            _patch_modules()
            if "forward" not in m.__dict__:
                m.forward = _gdn_forward.__get__(m)
            n += 1
    return n
