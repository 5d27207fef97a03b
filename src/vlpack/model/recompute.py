"""Activation checkpointing, whole or partial: which decoder layers and vision blocks recompute.

Full checkpointing recomputes every layer's forward in backward: about a third more compute for
the least activation memory. Where memory allows more than that but not everything (e.g.
qwen3-vl-8b on one GPU at 8k bins), `share` < 1 recomputes only the first part of each layer
stack and keeps the rest, trading the difference for speed (docs/benchmarks.md).

The seam is transformers' own: `GradientCheckpointingLayer.gradient_checkpointing`, a per-layer
flag that HF's enable call sets on every layer; we clear it on the layers that keep their
activations.
"""

from __future__ import annotations

import math

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer


def layer_stacks(model: nn.Module) -> dict[str, nn.ModuleList]:
    """The model's stacks of checkpointable layers (text decoder layers, vision blocks), by name."""
    return {
        name: module for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
        and all(isinstance(m, GradientCheckpointingLayer) for m in module)
    }


def recomputed_layers(share: float, n: int) -> int:
    """How many of a stack's `n` layers recompute at `share` (0: none): ceil(share × n), robust
    to the float rounding of share = k / n (the memory plan counts the same)."""
    return math.ceil(share * n - 1e-9) if share else 0


def enable_activation_checkpointing(model: nn.Module, share: float = 1.0) -> dict[str, int]:
    """Recompute in backward the first ceil(`share` × n) layers of each of `model`'s stacks.

    Returns the number of recomputed layers per stack name. `share=1.0` is HF's full
    checkpointing; non-reentrant checkpoints, so FSDP2's hooks and frozen inputs work.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"model.checkpoint_share={share}: use a share in (0, 1], e.g. 0.5 to "
                         "recompute half of each layer stack")
    stacks = layer_stacks(model)
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no checkpointable layer stack: set "
                         "model.activation_checkpointing=false for this model")
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:  # transformers before the rename (the H200 has 5.17)
        model.gradient_checkpointing_enable({"use_reentrant": False})
    recomputed = {}
    for name, stack in stacks.items():
        n = recomputed_layers(share, len(stack))
        for i, layer in enumerate(stack):
            layer.gradient_checkpointing = i < n
        recomputed[name] = n
    return recomputed
