"""The stock model inside a vlpack model: the reference side of `vlpack check`.

`stock_reference(model)` runs a block with none of vlpack's code in the model's forward:
  - every module given a vlpack seam subclass (seams.py: the vision tower and its attention,
    the base model's image features, the deepstack merge, Gated-DeltaNet) gets its stock
    transformers class back (Gated-DeltaNet: a subclass of it, below);
  - the text attention is transformers' SDPA;
  - MoE experts run transformers' `grouped_mm` (its default), not `vlpack_grouped_mm`;
  - the Gated-DeltaNet layers run transformers' own forward with its own torch kernels (conv
    and chunked delta rule) even where fla or causal-conv1d are importable and the stock
    forward would call them: `torch_kernel_class` is a subclass of the stock layer that
    overrides `forward` alone, with transformers' forward code bound to the torch functions
    behind its kernel wrappers. transformers picks a kernel once, when its modeling module is
    imported (`use_kernel_func_from_hub_with_fallback`, 5.17 and 5.24), and offers no choice at
    call time; its modeling module is never changed.
On exit everything is put back. The caller computes the loss with the model's own
`model(..., labels=...)` (forward.unpacked_forward with hf_labels).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator

from torch import nn

from vlpack.model.build import set_attn_implementation
from vlpack.model.gdn import GatedDeltaNet
from vlpack.model.seams import classes_of

STOCK_EXPERTS = "grouped_mm"
"""transformers' default experts implementation (what a stock build of the MoE families picks)."""
GDN_KERNELS = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
               "torch_recurrent_gated_delta_rule")
"""Kernel wrappers of transformers' Qwen3.5 modeling module (5.17, 5.24) that the Gated-DeltaNet
forward calls and that pick fla or causal-conv1d when importable."""


def _torch_function(fn: Callable) -> Callable:
    """The pure-torch function at the bottom of a chain of kernel wrappers."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _torch_forward(stock: type) -> Callable:
    """transformers' own `stock.forward`, its calls of `GDN_KERNELS` bound to their torch
    functions: the same code object over a copy of its module's names. The forward's
    decorators are left off: they rename a deprecated cache argument and fire accelerate's
    offloading hooks, neither of which a reference forward without a cache or hooks uses."""
    raw = inspect.unwrap(stock.forward)
    names = dict(vars(sys.modules[stock.__module__]))
    for name in GDN_KERNELS:
        if name in names:
            names[name] = _torch_function(names[name])
    fwd = types.FunctionType(raw.__code__, names, raw.__name__, raw.__defaults__,
                             raw.__closure__)
    fwd.__kwdefaults__ = raw.__kwdefaults__
    return functools.update_wrapper(fwd, raw)


@functools.cache
def torch_kernel_class(stock: type) -> type:
    """The stock Gated-DeltaNet class `stock` with `forward` alone overridden to run its torch
    kernels (`_torch_forward`); once per class, registered in this module under its name."""
    name = f"TorchKernels{stock.__name__}"
    cls = type(name, (stock,), {"__module__": __name__, "__qualname__": name,
                                "forward": _torch_forward(stock)})
    globals()[name] = cls
    return cls


def _reference_class(sub: type) -> type:
    """The class a module of vlpack seam class `sub` gets inside `stock_reference`."""
    stock = sub._vlpack_stock
    if issubclass(sub, GatedDeltaNet):
        return torch_kernel_class(stock)
    return stock


def _seam_classes(model: nn.Module) -> list[tuple[nn.Module, type]]:
    """(module, its vlpack subclass) for every module that has one."""
    return [(m, type(m)) for m in model.modules() if hasattr(type(m), "_vlpack_stock")]


@contextlib.contextmanager
def stock_reference(model: nn.Module) -> Iterator[nn.Module]:
    """`model` as stock transformers for the block (see the module docstring)."""
    importlib.import_module(type(model).__module__)  # the modeling module is loaded
    seams = _seam_classes(model)
    attn = model.config._attn_implementation
    config = getattr(model.config, "text_config", model.config)
    experts = getattr(config, "_experts_implementation", None)
    moe = classes_of(model).experts is not None
    try:
        for m, sub in seams:
            m.__class__ = _reference_class(sub)
        set_attn_implementation(model, "sdpa")
        if moe:
            model.set_experts_implementation(STOCK_EXPERTS)
        yield model
    finally:
        for m, sub in seams:
            m.__class__ = sub
        set_attn_implementation(model, attn)
        if moe and experts is not None:
            model.set_experts_implementation(experts)
