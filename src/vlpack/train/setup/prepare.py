"""How a built model becomes the model a run trains: `Preparation`, resolved once from the
config and the topology by `preparation` (the memory plan's recompute share joins it by
`Preparation.after`), and `prepare`, the one place the order is written: LoRA → freeze → hold
frozen weights in the compute dtype → int8 routed experts → activation checkpointing →
compile → FSDP2.

Every caller prepares through `prepare`, each over the steps it needs: the memory plan on meta
shapes up to int8, `build_base` (the build stage of the trainer and of `vlpack check`) LoRA,
the trainer's build the rest, rank 0's host copy of a sharded run and the export up to the held
dtypes (train/setup/stack.py, train/run/export.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from vlpack.config import Config, LoraConfig
from vlpack.train.distributed.parallel import Topology, apply_fsdp, ensure_process_group
from vlpack.train.setup import precision
from vlpack.train.setup.module import freeze

if TYPE_CHECKING:
    from vlpack.train.setup.memory import MemoryPlan

Step = Literal["lora", "freeze", "hold", "int8", "checkpoint", "compile", "fsdp"]
STEPS: tuple[Step, ...] = ("lora", "freeze", "hold", "int8", "checkpoint", "compile", "fsdp")
"""`prepare`'s steps, in their order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Preparation:
    """What `prepare` does to a built model (the `model.*` and `train.fsdp*` settings of a
    run, resolved for its device). The defaults prepare nothing."""

    model_name: str = "the model"
    """`model.name`, for the messages of a step that refuses the model."""
    lora: LoraConfig | None = None
    """The adapters to apply (None: no LoRA)."""
    freeze_vision: bool = False
    freeze_merger: bool = False
    freeze_llm: bool = False
    autocast: torch.dtype | None = None
    """The dtype a step autocasts to (None: float32, no autocast)."""
    frozen_dtype: torch.dtype | None = None
    """The dtype frozen linear and expert weights are held in, the rest float32
    (train/setup/precision.py; None: every parameter float32)."""
    build_dtype: torch.dtype = torch.float32
    """The dtype the model is built in (`precision.build_dtype`)."""
    int8_experts: bool = False
    """Hold the frozen routed experts' weights in int8 on the rank's device, and move the model
    there (`model.frozen_dtype=int8`)."""
    sharded: bool = False
    """FSDP2 applies: several processes, or `train.fsdp=always`."""
    host_build: bool = False
    """The model is built in host memory and its int8 experts quantized onto the device
    (`builds_on_host`)."""
    recompute_share: float = 0.0
    """The share of each layer stack that recomputes in backward (0: activation checkpointing
    off); the memory plan's (`after`), which resolves `model.checkpoint_share=auto`."""
    compile_scope: Literal["layers", "regions"] | None = None
    """`layers`, `regions`, or None (eager)."""
    trace_vision_attention: bool = False
    """With `layers`: trace the vision attention into the compiled blocks (else it stays eager)."""
    param_dtype: torch.dtype | None = None
    """FSDP2's parameter dtype in forward and backward (None: as held)."""
    reduce_dtype: torch.dtype = torch.float32
    """FSDP2's gradient reduction dtype."""
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    """FSDP2 keeps the parameter shards, gradients and optimizer state in host memory
    (`train.cpu_offload`); only with `sharded`."""

    @property
    def freezes(self) -> bool:
        """Whether anything is frozen: a LoRA base or a frozen group."""
        return bool(self.lora or self.freeze_vision or self.freeze_merger or self.freeze_llm)

    def after(self, plan: MemoryPlan) -> Preparation:
        """This preparation with the recompute share the memory plan chose."""
        return dataclasses.replace(self, recompute_share=plan.recompute_share)


def autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """bf16 when `model.dtype` asks for it (`auto`: on a GPU), else None (float32)."""
    if cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def is_sharded(cfg: Config, topo: Topology) -> bool:
    """Whether FSDP2 applies: several processes, or `train.fsdp=always`."""
    return topo.distributed or cfg.train.fsdp == "always"


def builds_on_host(cfg: Config, topo: Topology) -> bool:
    """Whether one process reads its model into host memory and quantizes it onto its
    accelerator expert by expert (`model.frozen_dtype=int8` with a checkpoint folder's weights:
    the device never holds the bf16 experts). Random weights are drawn on the device, as every
    GPU run draws them (a resume and the export draw the same ones again), and quantized there."""
    from vlpack.model.build import folder_has_weights

    m = cfg.model
    folder = Path(m.name)
    return (m.frozen_dtype == "int8" and topo.device.type != "cpu" and m.init != "random"
            and folder.is_dir() and folder_has_weights(folder))


def preparation(cfg: Config, topo: Topology, *,
                trace_vision_attention: bool = False) -> Preparation:
    """The preparation of run `cfg` on `topo`'s device. Its recompute share is 0 until the
    memory plan chose one (`Preparation.after`). `trace_vision_attention`: a benchmark's lever
    beyond the config (docs/benchmarks/levers.md)."""
    m, t = cfg.model, cfg.train
    autocast = autocast_dtype(cfg, topo.device)
    prep = Preparation(
        model_name=m.name, lora=m.lora if m.lora.rank else None,
        freeze_vision=m.freeze_vision, freeze_merger=m.freeze_merger, freeze_llm=m.freeze_llm,
        autocast=autocast, int8_experts=m.frozen_dtype == "int8", sharded=is_sharded(cfg, topo),
        host_build=builds_on_host(cfg, topo),
        compile_scope=m.compile_scope if m.compile else None,
        trace_vision_attention=trace_vision_attention, param_dtype=autocast,
        reduce_dtype=getattr(torch, t.reduce_dtype), reshard_after_forward=t.reshard_after_forward,
        cpu_offload=t.cpu_offload)
    low = precision.frozen_matmul_dtype(m.frozen_dtype, autocast) if prep.freezes else None
    return dataclasses.replace(prep, frozen_dtype=low,
                               build_dtype=precision.build_dtype(m.name, low))


def prepare(model: nn.Module, p: Preparation, *, first: Step = "lora", last: Step = "fsdp",
            topo: Topology | None = None, root: nn.Module | None = None,
            shapes: bool = False) -> None:
    """Prepare the built HF `model` in place by `p`, the steps `first` to `last` of LoRA →
    freeze → hold → int8 → checkpointing → compile → FSDP2 (a step `p` does not ask for is
    skipped). `topo`: the rank, whose device the int8 experts go to and whose process group
    FSDP2 shards over; `root`: the module whose forward runs a micro-batch, which FSDP2 shards
    with the model's blocks. `shapes`: `model` is the memory plan's meta model (LoRA's shapes
    stand in where peft is not installed, `lora.plan_lora`; the int8 experts by shape)."""
    steps = STEPS[STEPS.index(first): STEPS.index(last) + 1]
    if "lora" in steps and p.lora is not None:
        from vlpack.model import lora

        if shapes:
            lora.plan_lora(model, p.lora)
        else:
            lora.apply_lora(model, p.lora)
    if "freeze" in steps:
        freeze(model, vision=p.freeze_vision, merger=p.freeze_merger, llm=p.freeze_llm)
    if "hold" in steps:
        precision.hold_parameters(model, p.frozen_dtype, embedding=not p.sharded)
    if "int8" in steps and p.int8_experts:
        from vlpack.model.quant import quantize_experts

        assert topo is not None, "the int8 experts need the rank's device"
        device = torch.device("meta") if shapes else topo.device
        quantize_experts(model, device, model_name=p.model_name)  # expert by expert
        model.to(device)
        if device.type == "cuda":  # the bf16 experts' blocks, cached by the allocator
            torch.cuda.empty_cache()
    if "checkpoint" in steps and p.recompute_share:
        from vlpack.model.recompute import enable_activation_checkpointing

        enable_activation_checkpointing(model, p.recompute_share)
    if "compile" in steps and p.compile_scope is not None:
        from vlpack.model.compile import compile_layers, compile_regions

        if p.compile_scope == "layers":
            compile_layers(model, trace_vision_attention=p.trace_vision_attention)
        elif p.compile_scope == "regions":
            compile_regions(model)
        else:
            raise ValueError(f"compile scope {p.compile_scope!r}: use layers, regions or None")
    if "fsdp" not in steps:
        return
    if not p.sharded:
        if p.cpu_offload:
            raise ValueError("train.cpu_offload=true offloads FSDP2's shards, and this run is "
                             "not sharded: set train.fsdp=always (or run several processes)")
        return
    assert topo is not None and root is not None, "FSDP2 shards over the rank's process group"
    ensure_process_group(topo)
    apply_fsdp(root, model, topo, param_dtype=p.param_dtype, reduce_dtype=p.reduce_dtype,
               reshard_after_forward=p.reshard_after_forward, cpu_offload=p.cpu_offload)
