"""The stock model inside a vlpack model: the reference side of `vlpack check`.

`stock_reference(model)` runs a block with none of vlpack's code in the model's forward:
  - every module given a vlpack seam subclass (seams.py: the vision tower and its attention,
    the base model's image features, the deepstack merge, Gated-DeltaNet) gets its stock
    transformers class back (Gated-DeltaNet: a subclass of it, below);
  - the text attention is transformers' SDPA;
  - MoE experts run transformers' `grouped_mm` (its default), not `vlpack_grouped_mm`;
  - the Gated-DeltaNet layers run transformers' own forward with its own torch kernels (conv
    and chunked delta rule) even where fla or causal-conv1d are importable and the stock
    forward would call them. transformers picks a kernel once, when its modeling module is
    imported (`use_kernel_func_from_hub_with_fallback`, 5.17 and 5.24), and offers no choice at
    call time. So `torch_kernel_module` executes a second instance of that modeling module
    from its file while those packages are not importable (`KERNEL_PACKAGES` map to None in
    sys.modules for that moment, which makes their import fail): its wrappers pick the torch
    functions, and its Gated-DeltaNet class, transformers' code unchanged, is the reference
    layer's class. transformers' own module is never changed.
On exit everything is put back. The caller computes the loss with the model's own
`model(..., labels=...)` (forward.unpacked_forward with hf_labels).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

from torch import nn

from vlpack.model.build import set_attn_implementation
from vlpack.model.gdn import GatedDeltaNet
from vlpack.model.seams import classes_of

STOCK_EXPERTS = "grouped_mm"
"""transformers' default experts implementation (what a stock build of the MoE families picks)."""
KERNEL_PACKAGES = ("fla", "causal_conv1d")
"""Packages whose kernels transformers' Qwen3.5 modeling modules pick at import when importable."""


@functools.cache
def torch_kernel_module(name: str) -> types.ModuleType:
    """A second instance of transformers' modeling module `name`, executed from its own file
    while `KERNEL_PACKAGES` cannot be imported, so that its kernel wrappers chose their torch
    functions; registered as `<package>._vlpack_torch_kernels_<module>` beside it (transformers'
    own module and every name in it stay as they are). Once per module and process."""
    package, leaf = name.rsplit(".", 1)
    alias = f"{package}._vlpack_torch_kernels_{leaf}"
    spec = importlib.util.spec_from_file_location(alias, sys.modules[name].__file__)
    module = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules[k] for k in KERNEL_PACKAGES if k in sys.modules}
    sys.modules[alias] = module
    try:
        sys.modules.update(dict.fromkeys(KERNEL_PACKAGES))
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[alias]
        raise
    finally:
        for k in KERNEL_PACKAGES:
            del sys.modules[k]
        sys.modules.update(saved)
    return module


def torch_kernel_class(stock: type) -> type:
    """The stock Gated-DeltaNet class `stock` as defined by `torch_kernel_module`: the same
    code, its kernels the torch functions."""
    return getattr(torch_kernel_module(stock.__module__), stock.__name__)


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
