"""Will the model fit? An estimate from its shapes (built on the meta device) before anything is
allocated, so a model too large for the machine fails in a second with the numbers, not after
minutes with an out-of-memory kill.

One process builds the whole model in float32 on its device: 4 bytes per parameter. An FSDP2
run builds shapes only on every device and rank 0 builds the whole float32 model once in host
memory (`vlpack.train.parallel.load_full_state`): 4 bytes per parameter on rank 0's host. In
training, FSDP keeps 1/world of the float32 parameters, their gradients and AdamW's two moments
per device: 16 bytes per trainable parameter (4 per frozen one) over the world size; CPU ranks
of one host share its memory. Activations come on top and are not estimated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 2**30


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    params: int
    trainable: int
    build_bytes: int
    """Peak on one device while building (the whole float32 model; 0 when sharded)."""
    train_bytes: int
    """Per device in training: sharded parameters, gradients and optimizer state."""
    host_bytes: int = 0
    """Rank 0's whole float32 copy in host memory while a sharded run starts."""
    shard_bytes: int = 0
    """Per device, the float32 parameter shards alone (what exists while rank 0's copy does)."""


def estimate(params: int, trainable: int, world_size: int, sharing: int = 1,
             sharded: bool = False) -> MemoryEstimate:
    """Bytes per device for `params` parameters (`trainable` of them with gradients), FSDP over
    `world_size` ranks (`sharded`: FSDP2 applies, the model is built on the meta device),
    `sharing` ranks on one memory (CPU ranks of one host)."""
    build = 0 if sharded else 4 * params * sharing
    train = (4 * params + 12 * trainable) * sharing // max(world_size, 1)
    shards = 4 * params * sharing // max(world_size, 1)
    return MemoryEstimate(params, trainable, build, train, 4 * params if sharded else 0, shards)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of `device` now (None where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if device.type == "cpu" and meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_fits(est: MemoryEstimate, device: torch.device, free: int | None, *, model: str,
               holds_copy: bool = False) -> None:
    """ValueError with the numbers and the ways out when the estimate exceeds `free` bytes.
    `holds_copy`: this CPU device also holds rank 0's whole copy while the shards load (the
    copy is freed before gradients and optimizer state exist)."""
    if free is None:
        return
    loading = est.host_bytes + est.shard_bytes if holds_copy and device.type == "cpu" else 0
    need = max(est.build_bytes, est.train_bytes, loading)
    if need <= free:
        return
    what = ("building it in float32 would" if est.build_bytes == need else
            "rank 0's whole float32 copy and the float32 shards would" if loading == need else
            "its float32 weights, gradients and AdamW state (sharded by FSDP) would")
    raise ValueError(
        f"model.name={model} has {est.params / 1e9:.2f} B parameters ({est.trainable / 1e9:.2f} B "
        f"trainable): {what} take about {need / GIB:.1f} GiB on each {device.type} device, but "
        f"{free / GIB:.1f} GiB is free. Use a smaller model, more GPUs (FSDP shards the training "
        "state), or freeze parts of it (model.freeze_vision / freeze_llm)"
    )


def check_host_copy(est: MemoryEstimate, free: int | None, *, model: str) -> None:
    """ValueError when rank 0's host cannot hold the whole float32 model that a sharded run
    builds there once (accelerator runs; on CPU `check_fits` counts it)."""
    if free is None or est.host_bytes <= free:
        return
    raise ValueError(
        f"model.name={model}: a sharded run builds the whole float32 model once in rank 0's host "
        f"memory, about {est.host_bytes / GIB:.1f} GiB, but {free / GIB:.1f} GiB is free; run "
        "rank 0 on a host with more memory"
    )


def local_ranks() -> int:
    """Ranks of this job on this host (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
