"""`vlpack train`: the command around the trainer.

`train` runs it (its exit status: done, stopped by a signal after saving, or one message for a
non-finite loss or an out-of-memory step) or, with `--dry-run`, only prints the memory plan
(`print_plan`); `run` trains in this process, joining torchrun's group when launched by it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from vlpack.config import Config
from vlpack.data.loader import data_sources
from vlpack.train.distributed.parallel import Topology, barrier, init_distributed, shutdown
from vlpack.train.run.metrics import format_summary
from vlpack.train.setup import memory
from vlpack.train.setup.prepare import preparation
from vlpack.train.setup.stack import check_plan, describe_choice, fla_autotunes, plan_memory, shorten_to_plan
from vlpack.train.trainer import EXIT_STOPPED, NonFiniteLossError, RunOutOfMemoryError, Trainer


def run(cfg: Config) -> dict[str, Any]:
    """Train with `cfg` in this process (joins torchrun's group when launched by it)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    topo = init_distributed(cfg.parallel.cp)
    try:
        trainer = Trainer(cfg, topo)
        summary = trainer.fit()
        summary["stop_signal"] = trainer.stop_signal
        if topo.is_main:
            print(f"vlpack: {'stopped early' if trainer._stop else 'done'}\n{format_summary(summary)}",
                  flush=True)
        # no rank tears down while rank 0 still writes its plot and summary: torchrun stops every
        # worker when one fails, so a rank's failing exit would cut rank 0's report short
        barrier(topo)
        return summary
    finally:
        shutdown()


def print_plan(cfg: Config, device_memory: int | None = None) -> int:
    """Print the memory plan of `cfg` on this machine (no model is built), the configuration it
    chooses and whether it fits; with `device_memory`, for one GPU of that many bytes (less
    `memory.CUDA_CONTEXT`) in place of this machine's device. The data is not read, but a
    data file or folder that does not exist is refused, as the run would refuse it."""
    for source, path in data_sources(cfg.data):
        if path is not None and source != "synthetic" and not Path(path).exists():
            raise ValueError(f"data.source={source}: {path} does not exist (from {Path.cwd()}): "
                             "give the path of your data; the dry run reads none of it")
    if device_memory is not None:
        if cfg.parallel.cp != 1:
            raise ValueError("--device-memory plans one GPU: drop parallel.cp")
        topo = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
        free = device_memory - memory.CUDA_CONTEXT
        if free <= 0:
            raise ValueError(f"--device-memory {device_memory / memory.GIB:.2f} GiB is less than a "
                             "GPU's CUDA context takes: give the card's size, e.g. 80GiB")
        where = f"one GPU of {device_memory / memory.GIB:.1f} GiB ({free / memory.GIB:.1f} GiB free)"
    else:
        topo = init_distributed(cfg.parallel.cp)
        free = memory.available_bytes(topo.device)
        where = f"{topo.world_size} {topo.device.type} rank(s)"
    try:
        prep = preparation(cfg, topo)
        asked = cfg.data.seq_len
        # a GPU vlpack keeps no fla kernel configurations for autotunes them in step 1; a card
        # named by --device-memory is planned as one it keeps them for (the H100, the H200)
        if device_memory is not None:
            autotunes = not cfg.train.tuned_kernels
        else:
            autotunes = topo.device.type == "cuda" and fla_autotunes(
                cfg, torch.cuda.get_device_name(topo.device))
        plan, ways = plan_memory(cfg, topo, prep, free=free, autotunes=autotunes)
        if not topo.is_main:
            return 0
        print(f"vlpack: memory plan of {cfg.model.name} on {where}, per device "
              f"({plan.params / 1e9:.2f} B parameters, {plan.trainable / 1e9:.3f} B trainable; "
              f"data.seq_len={plan.seq_len}, parallel.cp={cfg.parallel.cp}):")
        print("\n".join(plan.lines()))
        try:
            check_plan(plan, cfg, topo, prep, ways, free=free, host=device_memory is None)
        except ValueError as e:
            print(f"does not fit: {e}")
            return 1
        shorten_to_plan(cfg, plan, topo, free)
        print(f"chooses: {describe_choice(cfg, plan, prep, asked_seq_len=asked)}")
        if free is not None:
            print(f"fits: {free / memory.GIB:.1f} GiB free")
        return 0
    finally:
        if device_memory is None:
            shutdown()


def train(cfg: Config, *, dry_run: bool = False, device_memory: int | None = None) -> int:
    """`vlpack train`: train with `cfg` (or, with `dry_run`, only print its memory plan); the
    exit status: 0 done, 1 the plan does not fit or the run stopped on a non-finite loss or out
    of memory (one message printed), EXIT_STOPPED stopped by a signal after saving."""
    if dry_run:
        return print_plan(cfg, device_memory)
    if not any(os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        # before the first CUDA allocation: segments that grow in place instead of a new block
        # per size, so the allocator's fragmentation stays small next to the memory plan's
        # headroom (docs/training.md, "What fits on one GPU")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        summary = run(cfg)
    except (NonFiniteLossError, RunOutOfMemoryError) as e:
        print(f"vlpack: error: {e}")
        return 1
    return EXIT_STOPPED if summary.get("stop_signal") is not None else 0
