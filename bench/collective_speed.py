"""FSDP2's collectives alone: all-gather and reduce-scatter bandwidth between this host's GPUs.

    torchrun --standalone --nproc-per-node 2 bench/collective_speed.py

Bus bandwidth as nccl-tests defines it: bytes × (n - 1) / n / time, per rank.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    for dtype, gib in ((torch.bfloat16, 1.0), (torch.float32, 1.0)):
        numel = int(gib * 2**30) // torch.tensor([], dtype=dtype).element_size()
        full = torch.empty(numel, dtype=dtype, device="cuda")
        shard = torch.empty(numel // n, dtype=dtype, device="cuda")
        ag = timed(lambda f=full, s=shard: dist.all_gather_into_tensor(f, s))
        rs = timed(lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f))
        if rank == 0:
            bus = gib * 2**30 * (n - 1) / n / 1e9
            print(f"{n} GPUs, {gib:.0f} GiB {str(dtype)[6:]}: all-gather {ag * 1e3:.1f} ms "
                  f"({bus / ag:.0f} GB/s bus), reduce-scatter {rs * 1e3:.1f} ms "
                  f"({bus / rs:.0f} GB/s bus)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
