"""`vlpack check --cp 2` with both ranks on one GPU (gloo carries the collectives: NCCL needs a
GPU per rank). A smoke run of the context-parallel GPU kernels (varlen attention against
gathered keys, fla under the gathered Gated-DeltaNet) on a one-GPU machine:

    torchrun --standalone --nproc-per-node 2 bench/cp_one_gpu.py tiny-qwen3_5_moe tiny-qwen3_vl
"""

import json
import sys

import torch.distributed as dist

from vlpack.check.command import check
from vlpack.model.context import ContextGroup

dist.init_process_group("gloo")
group = ContextGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
for name in sys.argv[1:]:
    r = check(name, context=group)
    if dist.get_rank() == 0:
        keep = ("model", "dtype", "cp", "passed", "failures", "max_logit_diff", "paths", "rule")
        print(json.dumps({k: r.get(k) for k in keep}, default=float), flush=True)
dist.destroy_process_group()
