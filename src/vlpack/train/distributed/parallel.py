"""Data parallelism: process group from torchrun's environment, FSDP2 sharding, reductions.

`torchrun --nproc-per-node N -m vlpack train ...` sets RANK/WORLD_SIZE/LOCAL_RANK; multi-node
runs add `--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT` (torchrun's standard
rendezvous); `srun` with one task per GPU works without torchrun (`train/distributed/slurm.py`). NCCL on
GPUs, gloo on CPUs. Model code never imports torch.distributed: sharding is applied from here,
one `fully_shard` per decoder block and per vision block, then the root.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from vlpack.train.distributed.slurm import torchrun_env


@dataclass(frozen=True, slots=True)
class Topology:
    """Who shares what: this process's rank and device, and the grid of ranks, `dp`
    data-parallel replicas × `cp` context-parallel ranks. Rank r is context rank r % cp of
    replica r // cp, so a context group sits on consecutive ranks (one host's GPUs); its ranks
    read the same rows and split each. FSDP2 shards over every rank."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cp: int = 1

    def __post_init__(self) -> None:
        if self.cp < 1 or self.world_size % self.cp:
            raise ValueError(f"parallel.cp={self.cp} needs a world size divisible by {self.cp}, "
                             f"got {self.world_size} processes: run torchrun with a multiple of "
                             f"{self.cp}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas: groups of `cp` ranks that read different rows."""
        return self.world_size // self.cp

    @property
    def dp_rank(self) -> int:
        """This rank's replica: which share of the data it reads."""
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context group: which chunks of each row it computes."""
        return self.rank % self.cp


def init_distributed(cp: int = 1) -> Topology:
    """Join the process group torchrun (or srun, `train/distributed/slurm.py`) describes, or run alone;
    pick this rank's device; `cp` ranks share each row (parallel.cp)."""
    os.environ.update(torchrun_env(os.environ))  # srun's task variables as torchrun's
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    topo_ = Topology(rank=rank, world_size=world, local_rank=local, device=torch.device("cpu"),
                     cp=cp)  # checks the grid before any group is joined
    if torch.cuda.is_available():
        # srun --gpus-per-task=1 shows each task only its own GPU
        device = torch.device("cuda", local if torch.cuda.device_count() > 1 else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        # 30 minutes, not NCCL's 10: at start the other ranks wait while rank 0 builds or reads
        # the whole model in host memory (load_full_state), which takes minutes for a 35B model
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=30))
    return replace(topo_, device=device)


def ensure_process_group(topo: Topology) -> None:
    """A process group for FSDP2 on a single process (`train.fsdp=always`): one rank, an
    in-memory store, no rendezvous."""
    if dist.is_initialized():
        return
    assert topo.world_size == 1, "several processes join torchrun's group in init_distributed"
    backend = "nccl" if topo.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(values: list[float], topo: Topology, op: str = "sum", *,
               axis: str = "world") -> list[float]:
    """Reduce a few host scalars across ranks in one collective (float64 for exact counts).
    `axis="dp"` reduces over data-parallel replicas a value that every rank of a context group
    holds alike (a row's counts): each group counts once."""
    if axis not in ("world", "dp"):
        raise ValueError(f"axis {axis!r}: use world or dp")
    if not topo.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=topo.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                           "min": dist.ReduceOp.MIN}[op])
    out = t.tolist()
    if axis == "dp" and op == "sum":  # the world sum holds each group's value cp times
        out = [x / topo.cp for x in out]
    return out


def barrier(topo: Topology) -> None:
    if topo.distributed:
        dist.barrier()


def broadcast_object(obj, topo: Topology):
    """Rank 0's `obj` on every rank."""
    if not topo.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def context_group(topo: Topology):
    """This rank's context-parallel group (`vlpack.model.context.ContextGroup`): the `cp`
    consecutive ranks of its replica. Every rank creates every group (torch.distributed's rule
    for new groups)."""
    from vlpack.model.context import ContextGroup

    if topo.cp == 1:
        return ContextGroup.single()
    groups = [dist.new_group(list(range(g * topo.cp, (g + 1) * topo.cp))) for g in range(topo.dp)]
    return ContextGroup(groups[topo.dp_rank], topo.cp_rank, topo.cp)


def per_replica(objs: list, topo: Topology) -> list:
    """Of every rank's object (rank order, all_gather_object), one per data-parallel replica:
    its context group's first rank's."""
    return objs[:: topo.cp]


def all_gather_object(obj, topo: Topology) -> list:
    """Every rank's `obj`, in rank order, on every rank (small picklable objects only)."""
    if not topo.distributed:
        return [obj]
    out = [None] * topo.world_size
    dist.all_gather_object(out, obj)
    return out


def apply_fsdp(
    root: torch.nn.Module, model: torch.nn.Module, topo: Topology, *,
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True, cpu_offload: bool = False,
) -> None:
    """FSDP2: shard each decoder block and each vision block of the HF `model`, then `root` (the
    module whose forward runs a whole micro-batch).

    With `param_dtype` (bf16 on GPU) parameters are all-gathered in that dtype and gradients are
    reduced in `reduce_dtype`; the master weights stay float32. `reshard_after_forward=False`
    keeps each block's gathered parameters until its backward (no second all-gather).
    `cpu_offload` (FSDP2's `CPUOffloadPolicy`): the parameter shards, their gradients and so the
    optimizer state live in host memory; each unit's parameters are copied to the device for its
    all-gather and its gradients back after the reduce-scatter.

    The root always keeps its parameters (embedding, lm_head, final norm, vision merger) gathered
    from forward to backward, FSDP2's own default for a root. It must: FSDP2 re-gathers a module
    for backward from hooks on the tensors its forward returns, and up to torch 2.11 it looks
    for them with pytree, which does not enter our `ForwardOut` dataclass. A root resharded after
    forward then reached backward with freed parameters: "CUDA illegal memory access" in the
    final norm's backward on 2 H200s (the 8B recipe), a segfault on CPU.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(topo.device.type, (topo.world_size,))
    # FSDP2 casts nothing: by default it casts a module's floating inputs to param_dtype, which
    # (a) it skips when a checkpointed block recomputes in backward, so the vision rotary's
    # fp32 cos/sin reached the forward in bf16 and the recomputation in fp32, and activation
    # checkpointing refused it (CheckpointError, the 8B recipe on 2 H200s); and (b) rounded the
    # root's fp32 per-sample loss weights (train.loss_norm=sample) to bf16. Hidden states already
    # arrive in bf16 from the root's embeddings, and the patch embedding casts the pixels itself,
    # as on one GPU under autocast.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                              cast_forward_inputs=False)
    offload = (CPUOffloadPolicy(pin_memory=topo.device.type == "cuda") if cpu_offload
               else OffloadPolicy())
    inner = model.model
    blocks = list(inner.language_model.layers) + list(inner.visual.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=offload)  # see above


def load_full_state(model: torch.nn.Module, full: torch.nn.Module | None, topo: Topology, *,
                    cpu_offload: bool = False) -> None:
    """Materialise the meta-built, FSDP2-sharded `model` on `topo.device` with the weights and
    buffers of `full`, the same model built whole on rank 0's CPU (None on the other ranks).

    Each rank then holds only its shards: no rank ever has the whole model on its accelerator
    (a 35B model in fp32 is 140 GB, more than one H200). Buffers (rotary tables and the like,
    not all in the state dict) are broadcast; parameters and persistent buffers arrive through
    `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`, each rank keeping
    its shard. Collective. `cpu_offload`: the parameter shards stay in host memory (FSDP2's
    `CPUOffloadPolicy`), the buffers go to the device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    buffers = broadcast_object(
        {n: b.detach().clone() for n, b in full.named_buffers()} if topo.is_main else None, topo)
    model.to_empty(device="cpu" if cpu_offload else topo.device)
    if cpu_offload:  # the shards stay in host memory, the buffers go to the device
        moved: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = moved.setdefault(id(b), b.to(topo.device))
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    state = full.state_dict() if topo.is_main else {}
    set_model_state_dict(model, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=True))
