"""The stock model inside a vlpack model: the reference side of `vlpack check`.

`stock_reference(model)` runs a block with none of vlpack's code in the model's forward:
  - every module given a vlpack seam subclass (seams.py: the vision tower and its attention,
    the base model's image features, the deepstack merge, Gated-DeltaNet) gets its stock
    transformers class back;
  - the text attention is transformers' SDPA;
  - MoE experts run transformers' `grouped_mm` (its default), not `vlpack_grouped_mm`;
  - the Gated-DeltaNet layers run transformers' own torch kernels (conv and chunked delta
    rule) even where fla or causal-conv1d are importable and the stock forward would pick
    them: the kernel wrappers of the modeling module are unwrapped to the torch functions they
    fall back to, for the block's duration only.
On exit everything is put back. The caller computes the loss with the model's own
`model(..., labels=...)` (forward.unpacked_forward with hf_labels).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator

from torch import nn

from vlpack.model.build import set_attn_implementation
from vlpack.model.seams import classes_of

STOCK_EXPERTS = "grouped_mm"
"""transformers' default experts implementation (what a stock build of the MoE families picks)."""
GDN_KERNELS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
"""Module-level kernel wrappers of transformers' Qwen3.5 modeling module (5.24) that pick fla or
causal-conv1d when importable; unwrapped inside `stock_reference`."""


def _torch_function(fn: Callable) -> Callable:
    """The pure-torch function at the bottom of a chain of kernel wrappers."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def _swapped(targets: list[tuple[object, str, object]]) -> Iterator[None]:
    """Set each (object, attribute, value) for the block; restore the old values after."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in targets]
    try:
        for obj, name, value in targets:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def _gdn_torch_kernels(model: nn.Module) -> list[tuple[object, str, object]]:
    """The swaps that make transformers' Gated-DeltaNet forward run its torch kernels: the
    modeling module's kernel wrappers (5.24), or the layer attributes holding fla's functions
    (5.17: `causal_conv1d_fn` is None without fla, `chunk_gated_delta_rule` the torch one)."""
    stock = classes_of(model).gated_deltanet
    if stock is None:
        return []
    mod = sys.modules[stock.__module__]
    swaps: list[tuple[object, str, object]] = []
    for name in GDN_KERNELS:
        fn = mod.__dict__.get(name)
        if fn is not None and _torch_function(fn) is not fn:
            swaps.append((mod, name, _torch_function(fn)))
    torch_rule = mod.__dict__.get("torch_chunk_gated_delta_rule")
    for m in model.modules():
        if not isinstance(m, stock):
            continue
        if "causal_conv1d_fn" in m.__dict__:
            swaps.append((m, "causal_conv1d_fn", None))
        if "chunk_gated_delta_rule" in m.__dict__ and torch_rule is not None:
            swaps.append((m, "chunk_gated_delta_rule", _torch_function(torch_rule)))
    return swaps


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
            m.__class__ = sub._vlpack_stock
        set_attn_implementation(model, "sdpa")
        if moe:
            model.set_experts_implementation(STOCK_EXPERTS)
        with _swapped(_gdn_torch_kernels(model)):
            yield model
    finally:
        for m, sub in seams:
            m.__class__ = sub
        set_attn_implementation(model, attn)
        if moe and experts is not None:
            model.set_experts_implementation(experts)
