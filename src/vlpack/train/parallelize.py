"""One order for making a built model trainable: freeze → hold frozen weights in the compute
dtype (or int8) → activation checkpointing → compile → FSDP2. The trainer and the benchmarks call
`parallelize`, so a benchmark's figures come from the model `vlpack train` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlpack.train.module import freeze
from vlpack.train.parallel import Topology, apply_fsdp, ensure_process_group
from vlpack.train.precision import hold_int8_experts, hold_parameters


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How to prepare the model (the `model.*` and `train.fsdp*` settings of a run)."""

    freeze_vision: bool = False
    freeze_merger: bool = False
    freeze_llm: bool = False
    frozen_dtype: torch.dtype | None = None
    """Hold frozen linear and expert weights in this dtype, the rest in float32
    (`vlpack.train.precision`; None: every parameter float32)."""
    int8_experts: bool = False
    """Then hold the frozen routed experts' weights in int8 on the rank's device, and move the
    model there (`model.frozen_dtype=int8`: a folder's model is built in host memory)."""
    recompute_share: float = 0.0
    """The share of each layer stack that recomputes in backward (0: activation checkpointing
    off; the memory plan's, which resolves `model.checkpoint_share=auto`)."""
    compile_scope: str | None = None
    """`layers`, `regions`, or None (eager)."""
    trace_vision_attention: bool = False
    """With `layers`: trace the vision attention into the compiled blocks (else it stays eager)."""
    fsdp: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    """FSDP2 keeps the parameter shards, gradients and optimizer state in host memory
    (`train.cpu_offload`); only with `fsdp`."""


def parallelize(model: nn.Module, root: nn.Module, info: Topology, p: Parallelism) -> bool:
    """Apply `p` to the HF `model` in place; FSDP2 shards its blocks and `root` (the module whose
    forward runs a micro-batch). Returns whether FSDP2 was applied."""
    from vlpack.model.compile import compile_layers, compile_regions
    from vlpack.model.recompute import enable_activation_checkpointing

    freeze(model, vision=p.freeze_vision, merger=p.freeze_merger, llm=p.freeze_llm)
    hold_parameters(model, p.frozen_dtype)
    if p.int8_experts:
        hold_int8_experts(model, info.device)
    if p.recompute_share:
        enable_activation_checkpointing(model, p.recompute_share)
    if p.compile_scope == "layers":
        compile_layers(model, trace_vision_attention=p.trace_vision_attention)
    elif p.compile_scope == "regions":
        compile_regions(model)
    elif p.compile_scope is not None:
        raise ValueError(f"compile scope {p.compile_scope!r}: use layers, regions or None")
    if not p.fsdp:
        if p.cpu_offload:
            raise ValueError("train.cpu_offload=true offloads FSDP2's shards, and this run is "
                             "not sharded: set train.fsdp=always (or run several processes)")
        return False
    ensure_process_group(info)
    apply_fsdp(root, model, info, param_dtype=p.param_dtype, reduce_dtype=p.reduce_dtype,
               reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload)
    return True
