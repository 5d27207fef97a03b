"""Regional torch.compile: fuse the elementwise work around the matmuls, in two scopes.

`regions` (`compile_regions`): the eager packed step spends much of its kernel time outside
matmuls and attention (docs/benchmarks/profiles.md): dtype casts, multiplies and adds, many of
them in the norms, the gated MLPs and the rotary embeddings.
Compiling those (and only those) lets inductor fuse them; the decoder layers, the attention seams
and the Gated-DeltaNet kernels stay eager.

`layers` (`compile_layers`): the compiled step still left the GPU idle a quarter of the time,
waiting for a host that launches each projection, cast and residual add from Python. Compiling
each decoder layer and vision block whole cuts the host's work per layer. The attention call
itself (vlpack's varlen function), the vision attention and any MoE block or Gated-DeltaNet
module stay eager behind `torch.compiler.disable`, so the boundary contract (cu_seqlens, host
bounds, positions) is handled by the same eager code in both scopes. The norms and MLPs inside
those eager modules (an MoE block's shared expert, Gated-DeltaNet's gated norm) compile as
regions, as in `regions`.

Routed experts, in both scopes: the module stays eager, and the dispatch around its two grouped
GEMMs (gathers, casts, the SiLU gate and routing weight, the sum over each token's experts) runs as one
compiled function shared by every layer (`experts.vlpack_experts_forward_compiled`): every tensor in
it has a size fixed by the token count, so it compiles like the layers do.

`dynamic=True`: packed bins have a different token count every step; one graph serves all.
Each dynamic size gets its own symbol (`_distinct_sizes`): torch's duck shaping would give sizes
that happen to be equal at the first trace one symbol and guard on their equality, so a first row
of 3 segments (`cu_seq_lens` of 4, as many as the MRoPE position rows) recompiled the layers'
shared graphs at the next row, a step closer to dynamo's recompile limit (past it, the layers run
eager).

Dynamo keeps one graph per variant of a compiled function's code, and its default limit of 8
variants is too few for the layers (`_room_for_variants`): transformers 5.25 wraps every layer
class's forward in one checkpointing function (`forward_with_checkpointing`, a single code object
for the decoder layers and the vision blocks; 5.17 checkpoints around the module call, outside
the compiled code), whose variants multiply by the layer kind (vision block, Gated-DeltaNet or
attention layer), recomputed or not, an input that needs no gradient (the first layer after
frozen embeddings) and training or evaluation: a LoRA run with half of each stack recomputed and
an evaluation reached 9, and the variant past the limit ran eager for the rest of the run.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable

import torch
from torch import nn

from vlpack.model.seams import classes_of

# Which modules: the family registry's `compiled` classes (text and vision RMSNorms and MLPs,
# dense and shared-expert) and torch's LayerNorm (the vision blocks' norms, which autocast runs in
# fp32 with a cast on each side) are compiled as regions. Inside a compiled layer these stay
# eager (`StockClasses.eager`; their own norms and MLPs compile as regions): MoE blocks (the
# routed experts' dispatch is compiled apart), Gated-DeltaNet (fla kernels and per-segment
# state resets keyed on host boundaries) and the vision attention module, unless
# `trace_vision_attention`: then only its kernel call (`vision.attend_row`) breaks the graph,
# and the projections, rotary and casts are traced.
# That variant is off by default: it is slower on the 35B cut (docs/benchmarks/levers.md).

_log = logging.getLogger(__name__)


def _distinct_sizes() -> None:
    """No duck shaping in this process's compiled code (module docstring): torch's switch for it
    is process-wide, and a size that differs from another only by chance is never the same size
    in vlpack's graphs."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False


RECOMPILE_LIMIT = 64
"""Variants dynamo may compile per function's code in a process that compiles vlpack's layers
(module docstring); torch's default is 8."""


def _room_for_variants() -> None:
    """Raise dynamo's process-wide recompile limit to `RECOMPILE_LIMIT` (never lower it; older
    torch names it `cache_size_limit`)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))


def compile_regions(model: nn.Module) -> list[str]:
    """Compile every norm and MLP module of `model` in place, and its vision rotary; return what
    was compiled (class and function names)."""
    _distinct_sizes()
    _room_for_variants()
    names = _compile_norms_and_mlps(model)
    if not names:
        raise ValueError(
            f"model.compile found no norm or MLP module in {type(model).__name__}: "
            "set model.compile=false for this model"
        )
    return sorted(names) + _compile_rotary(model) + _compile_experts(model)


def compile_layers(model: nn.Module, trace_vision_attention: bool = False) -> list[str]:
    """Compile every decoder layer and vision block of `model` whole (the attention kernels and
    the family's eager modules stay eager; the vision attention is traced with
    `trace_vision_attention`), the norms and MLPs outside them as regions, and the vision rotary;
    return what was compiled (class and function names)."""
    from vlpack.model.recompute import layer_stacks

    _distinct_sizes()
    _room_for_variants()
    layers = [layer for stack in layer_stacks(model).values() for layer in stack]
    if not layers:
        raise ValueError(f"model.compile_scope=layers found no layer stack in "
                         f"{type(model).__name__}: use model.compile_scope=regions")
    cls = classes_of(model)
    eager = tuple(c for c in cls.eager
                  if not (trace_vision_attention and c is cls.vision_attention))
    traced: set[int] = set()  # modules a compiled layer traces (not those inside eager ones)
    names: set[str] = set()
    for layer in layers:
        islands = [m for m in layer.modules() if isinstance(m, eager)]
        in_island = {id(sub) for m in islands for sub in m.modules() if sub is not m}
        traced |= {id(m) for m in layer.modules() if id(m) not in in_island}
        for m in islands:
            _keep_eager(m)
        layer.compile(dynamic=True)
        names.add(type(layer).__name__)
    # norms and MLPs outside the layers, and inside their eager modules (the shared expert of
    # an MoE block, Gated-DeltaNet's gated norm), compile as regions
    names |= _compile_norms_and_mlps(model, skip=traced)
    return sorted(names) + _compile_rotary(model) + _compile_experts(model)


def _compile_norms_and_mlps(model: nn.Module, skip: set[int] | None = None) -> set[str]:
    """Compile each norm and MLP module of `model` (its family's `compiled` classes) whose id is
    not in `skip`; return their class names."""
    compiled = classes_of(model).compiled
    names: set[str] = set()
    for module in model.modules():
        if isinstance(module, compiled) and id(module) not in (skip or ()):
            module.compile(dynamic=True)
            names.add(type(module).__name__)
    return names


def _keep_eager(module: nn.Module) -> None:
    """Make `module`'s forward a graph break: its own forward function (vlpack's wrapper where
    one is installed), disabled and bound to it anew, so a deep copy of the model rebinds it to
    the copy. Idempotent."""
    forward = module.forward
    if getattr(forward, "_vlpack_eager", False):
        return
    if not isinstance(forward, types.MethodType) or forward.__self__ is not module:
        raise ValueError(f"model.compile_scope=layers cannot keep {type(module).__name__} eager: "
                         "its forward is not a method of the module; use "
                         "model.compile_scope=regions")
    fn = torch.compiler.disable(forward.__func__)
    fn._vlpack_eager = True
    module.forward = types.MethodType(fn, module)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def _compile_experts(model: nn.Module) -> list[str]:
    """Routed experts (MoE families built with vlpack's experts): the module stays eager in both
    scopes, its token dispatch around the grouped GEMMs runs compiled (experts.py's
    `vlpack_experts_forward_compiled`, set through transformers' experts interface)."""
    from vlpack.model import experts

    text = model.config.get_text_config()
    if getattr(text, "_experts_implementation", None) != experts.IMPLEMENTATION:
        return []
    model.set_experts_implementation(experts.COMPILED)
    return ["vlpack_experts_dispatch"]


def _compile_rotary(model: nn.Module) -> list[str]:
    """The vision rotary (`apply_rotary_pos_emb_vision`: it upcasts q and k to fp32 and runs
    about 16 elementwise kernels per block), compiled and given to each of vlpack's vision
    attention modules, which call it (vision.py); the modeling module is left as it is. The text
    rotary runs inside the compiled decoder layers (`layers`) or eager (`regions`)."""
    from vlpack.model.vision import VisionAttention

    done = set()
    for m in model.modules():
        if isinstance(m, VisionAttention):
            fn = sys.modules[m._vlpack_stock.__module__].apply_rotary_pos_emb_vision
            m.vlpack_rotary = _compiled(fn)
            done.add("apply_rotary_pos_emb_vision")
    if not done:
        _log.warning("model.compile: %s has no vlpack vision attention; its rotary stays eager",
                     type(model).__name__)
    return sorted(done)
