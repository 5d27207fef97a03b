"""Boundary-aware Gated-DeltaNet (Qwen3.5 linear-attention layers) for packed rows.

transformers' GDN forward calls two functions of its modeling module: `causal_conv1d_fn` (the
short causal conv) and `torch_chunk_gated_delta_rule`, and hands both the forward's keyword
arguments, vlpack's `Boundaries` (`vlpack_bounds`) among them. Their stock implementations
cannot keep samples apart: the torch conv silently mixes neighbours across a boundary, the torch
delta rule raises. vlpack replaces the two module functions with dispatchers (`patch_modules`,
at build time). A dispatcher called with the forward's Boundaries restarts at every segment:
  GPU + fla importable + half precision → fla's `causal_conv1d` / `chunk_gated_delta_rule`
                                          with `cu_seqlens`;
  otherwise → the torch reference run once per segment (exact, slower; said once).
Called without Boundaries (a stock model in the same process, an unpacked sample) it calls the
stock function unchanged; with `Boundaries(text=None, gdn_torch_reference=True)` it calls
transformers' torch kernels even where fla is importable (`vlpack check`'s reference).

This is the one place vlpack replaces names inside transformers (docs/model.md says why: the
GDN forward differs between supported transformers versions, so a subclass would restate
version-specific arithmetic, and transformers' own kernel seam needs the hub `kernels` package).

fla 0.6.0 refuses the backward of its gated delta rule on Hopper with Triton 3.4-3.7.0 (wrong
results, fla #640) unless tilelang is installed; vlpack then runs the delta rule with the
per-segment torch reference when gradients are needed (the conv still uses fla), and says so.

Legend: B = batch (1 when packed), C = conv channels, T = tokens, W = conv width,
Hk/Hv = key/value heads, Dk/Dv = head dims.
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

from vlpack.model.bounds import BOUNDS_KWARG, Boundaries, Segments


@functools.cache
def _fla() -> tuple[Callable, Callable] | None:
    """fla's (causal_conv1d, chunk_gated_delta_rule), or None when fla cannot run here."""
    try:
        conv = importlib.import_module("fla.modules.causal_conv1d.ops").causal_conv1d
        gdr = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:
        return None
    return conv, gdr


def _fla_bounds(fn: Callable, segs: Segments, bounds: Boundaries | None, device) -> dict:
    """The boundary kwargs of an fla call: `cu_seqlens` on the device and, where fla takes it,
    `cu_seqlens_cpu`, the host copy, so fla derives its chunk indices without reading the device
    tensor back. Within one forward every GDN layer gets the same two tensors
    (`Boundaries.fla_cu`)."""
    if bounds is not None and bounds.text is segs:
        cu_dev, cu_cpu = bounds.fla_cu(torch.device(device))
    else:
        cu_cpu = torch.tensor(segs.host, dtype=torch.long)
        cu_dev = cu_cpu.to(device)
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


def _torch_kernel(original: Callable) -> Callable:
    """transformers' pure-torch function behind its kernel-selecting wrapper."""
    return getattr(original, "__wrapped__", original)


def _use_fla(x: torch.Tensor) -> bool:
    """fla's kernels for half-precision inputs on CUDA. float32 inputs run the exact per-segment
    torch path: fla's Triton kernels multiply in TF32 there (its fp32 delta-rule forward puts the
    tiny Qwen3.5's logits past the contract's float32 tolerance: docs/benchmarks/gpu_tests.md),
    and float32 is what `vlpack check` proves the boundary contract in."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if _fla() is None:
        warnings.warn("vlpack: fla is not importable; Gated-DeltaNet runs the per-segment torch "
                      "reference (correct, slower). Install fla-core + flash-linear-attention.",
                      stacklevel=2)
        return False
    return True


# --- short causal conv --------------------------------------------------------------------------
def segment_conv1d(x_BCT, weight_CW, bias_C, activation: str | None, segs: Segments, *,
                   bounds: Boundaries | None = None):
    """Causal depthwise conv that restarts at every boundary of `segs` (B must be 1); the
    kernel's name lands in `bounds.paths` when given."""
    from transformers.activations import ACT2FN

    B, C, T = x_BCT.shape
    if B != 1:
        raise ValueError("packed Gated-DeltaNet needs batch size 1 (one packed row)")
    segs.check(T, "Gated-DeltaNet")
    paths = bounds.paths if bounds is not None else {}
    if _use_fla(x_BCT):
        paths["gdn.conv"] = "fla causal_conv1d (cu_seqlens)"
        conv = _fla()[0]
        y_BTC, _ = conv(x_BCT.transpose(1, 2).contiguous(), weight=weight_CW, bias=bias_C,
                        activation=activation, **_fla_bounds(conv, segs, bounds, x_BCT.device))
        return y_BTC.transpose(1, 2).to(x_BCT.dtype)
    paths["gdn.conv"] = "per-segment torch conv1d"
    bounds_S1 = segs.host
    pad = weight_CW.shape[-1] - 1
    x = x_BCT.to(weight_CW.dtype)
    outs = [
        F.conv1d(x[:, :, s:e], weight_CW.unsqueeze(1), bias_C, padding=pad, groups=C)[:, :, : e - s]
        for s, e in itertools.pairwise(bounds_S1)
    ]
    y = torch.cat(outs, dim=-1)
    if activation is not None:
        y = ACT2FN[activation](y)
    return y.to(x_BCT.dtype)


def _conv_dispatch(original: Callable) -> Callable:
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        bounds = kwargs.pop(BOUNDS_KWARG, None)
        if bounds is None or bounds.text is None:
            fn = _torch_kernel(original) if bounds is not None and bounds.gdn_torch_reference \
                else original
            return fn(hidden_states, weight, bias, activation=activation, **kwargs)
        if kwargs.get("seq_idx") is not None:
            raise ValueError("pass boundaries as vlpack's Boundaries, not seq_idx")
        return segment_conv1d(hidden_states, weight, bias, activation, bounds.text, bounds=bounds)

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
        bounds = kwargs.pop(BOUNDS_KWARG, None)
        if bounds is None or bounds.text is None:
            fn = _torch_kernel(original) if bounds is not None and bounds.gdn_torch_reference \
                else original
            return fn(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                      cu_seqlens=cu_seqlens, **common, **kwargs)
        B, T = query.shape[:2]
        if B != 1:
            raise ValueError("packed Gated-DeltaNet needs batch size 1 (one packed row)")
        if initial_state is not None or output_final_state:
            raise ValueError("packed Gated-DeltaNet runs without a cache: call with "
                             "use_cache=False")
        segs = bounds.text
        segs.check(T, "Gated-DeltaNet")
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value, g, beta))
        if _use_fla(query) and needs_grad and not fla_delta_rule_backward_ok():
            warnings.warn("vlpack: fla's gated-delta-rule backward is disabled on this GPU/Triton "
                          "(Hopper + Triton < 3.7.1, fla #640; install tilelang or Triton "
                          ">= 3.7.1); the delta rule runs per segment in torch", stacklevel=2)
        elif _use_fla(query):
            bounds.paths["gdn.delta_rule"] = "fla chunk_gated_delta_rule (cu_seqlens)"
            gdr = _fla()[1]
            out, _ = gdr(query, key, value, g=g, beta=beta,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         **_fla_bounds(gdr, segs, bounds, query.device))
            return out, None
        if torch_fn is None:
            raise ValueError("cannot find transformers' torch gated-delta-rule to run per "
                             "segment; install fla (fla-core + flash-linear-attention)")
        bounds.paths["gdn.delta_rule"] = "per-segment torch chunk_gated_delta_rule"
        outs = [
            torch_fn(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                     chunk_size=chunk_size, **common)[0]
            for s, e in itertools.pairwise(segs.host)
        ]
        return torch.cat(outs, dim=1), None

    torch_chunk_gated_delta_rule._vlpack = True
    return torch_chunk_gated_delta_rule


@functools.cache
def patch_modules(module_name: str) -> None:
    """Put the dispatchers into the modeling module `module_name` (once per process)."""
    mod = importlib.import_module(module_name)
    for attr, make in (("causal_conv1d_fn", _conv_dispatch),
                       ("torch_chunk_gated_delta_rule", _gdr_dispatch)):
        fn = getattr(mod, attr, None)
        if fn is None:
            raise ValueError(f"{module_name} has no {attr}: this transformers version's "
                             "Gated-DeltaNet is not supported by vlpack (tested: 5.17, 5.24)")
        if not getattr(fn, "_vlpack", False):
            setattr(mod, attr, make(fn))
