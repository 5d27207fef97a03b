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
    imported (`use_kernel_func_from_hub_with_fallback`, 5.17 to 5.25), and offers no choice at
    call time. So `torch_kernels.torch_kernel_module` executes a second instance of that
    modeling module from its file while those packages cannot be imported: its wrappers pick
    the torch functions. For the block each Gated-DeltaNet layer is replaced in its parent by
    a layer of that copy's class, built by its own `__init__` (with the `kernels` package
    installed, transformers 5.25 gives each instance its own kernel wrappers, made from the
    module that defined the class) and holding the model's parameter objects. transformers'
    own module is never changed.
On exit everything is put back. The caller computes the loss with the model's own
`model(..., labels=...)` (forward.unpacked_forward with hf_labels).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from torch import nn

from vlpack.model.build import set_attn_implementation
from vlpack.model.gdn import GatedDeltaNet
from vlpack.model.seams import classes_of
from vlpack.model.torch_kernels import torch_kernel_module

STOCK_EXPERTS = "grouped_mm"
"""transformers' default experts implementation (what a stock build of the MoE families picks)."""
def torch_kernel_class(stock: type) -> type:
    """The stock Gated-DeltaNet class `stock` as defined by `torch_kernel_module`: the same
    code, its kernels the torch functions."""
    return getattr(torch_kernel_module(stock.__module__), stock.__name__)


def torch_kernel_layer(layer: nn.Module, config) -> nn.Module:
    """A Gated-DeltaNet layer of `torch_kernel_class`, built by its own `__init__` (so that
    whatever transformers and the `kernels` package attach to an instance comes from the
    copy's functions too) and holding `layer`'s submodules and parameters themselves: gradients
    of the reference land on the model's parameters, and a projection that LoRA wraps stays
    wrapped."""
    cls = torch_kernel_class(type(layer)._vlpack_stock)
    with torch.device("meta"):
        ref = cls(config, layer.layer_idx)
    for name, child in layer.named_children():
        setattr(ref, name, child)
    for name, p in layer.named_parameters(recurse=False):
        setattr(ref, name, p)
    for name, b in layer.named_buffers(recurse=False):
        ref.register_buffer(name, b)
    assert not any(t.is_meta for t in (*ref.parameters(), *ref.buffers())), \
        "the reference layer holds a tensor the model's layer does not"
    return ref.train(layer.training)


def _seams(model: nn.Module) -> tuple[list[tuple[nn.Module, type]], list[tuple[nn.Module, str]]]:
    """(module, its vlpack subclass) of every seam but Gated-DeltaNet, and (parent, name) of
    every Gated-DeltaNet layer."""
    classes, layers = [], []
    for parent in model.modules():
        for name, m in parent.named_children():
            if isinstance(m, GatedDeltaNet):
                layers.append((parent, name))
    for m in model.modules():
        if hasattr(type(m), "_vlpack_stock") and not isinstance(m, GatedDeltaNet):
            classes.append((m, type(m)))
    return classes, layers


@contextlib.contextmanager
def stock_reference(model: nn.Module) -> Iterator[nn.Module]:
    """`model` as stock transformers for the block (see the module docstring)."""
    importlib.import_module(type(model).__module__)  # the modeling module is loaded
    seams, gdn_layers = _seams(model)
    attn = model.config._attn_implementation
    config = getattr(model.config, "text_config", model.config)
    experts = getattr(config, "_experts_implementation", None)
    moe = classes_of(model).experts is not None
    layers = [(parent, name, getattr(parent, name)) for parent, name in gdn_layers]
    try:
        for m, sub in seams:
            m.__class__ = sub._vlpack_stock
        for parent, name in gdn_layers:
            setattr(parent, name, torch_kernel_layer(getattr(parent, name), config))
        set_attn_implementation(model, "sdpa")
        if moe:
            model.set_experts_implementation(STOCK_EXPERTS)
        yield model
    finally:
        for m, sub in seams:
            m.__class__ = sub
        for parent, name, layer in layers:
            setattr(parent, name, layer)
        set_attn_implementation(model, attn)
        if moe and experts is not None:
            model.set_experts_implementation(experts)
