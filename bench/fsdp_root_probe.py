"""Does FSDP2 survive a large root unit? A toy with the 8B's embedding and lm_head shapes.

    torchrun --standalone --nproc-per-node 2 bench/fsdp_root_probe.py --hidden 4096 [--tied]
        [--split] [--reduce bf16]

The qwen3-vl-8b recipe stopped with "CUDA illegal memory access" in its first backward under
FSDP2 on 2 GPUs while the tied 2B ran. The 8B's root unit holds an untied 151,936 × 4,096
embedding and lm_head (1.24 G parameters: 2.5 GB gathered in bf16, 5 GB reduced in fp32); the
2B's holds one 151,936 × 2,048 matrix. This runs one forward + backward + optimizer-free
gradient check of a toy with those matrices, one case per process (a fault poisons the CUDA
context), and prints `ok` or the error. `--split` shards the embedding and lm_head as their own
units.
"""

from __future__ import annotations

import argparse
import os
import traceback

import torch
import torch.distributed as dist


class Toy(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        h_TH = self.embed(ids_T)
        for block in self.blocks:
            h_TH = h_TH + torch.tanh(block(h_TH))
        return torch.nn.functional.cross_entropy(self.head(h_TH).float(), ids_T.roll(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--split", action="store_true")
    p.add_argument("--reduce", choices=("fp32", "bf16"), default="fp32")
    a = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a gloo smoke run of the script
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    rank = dist.get_rank()
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = init_device_mesh(dev, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Toy(a.vocab, a.hidden, a.tied).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=(
        torch.float32 if a.reduce == "fp32" else torch.bfloat16))
    units = list(model.blocks) + ([model.embed, model.head] if a.split and not a.tied else [])
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    root_numel = sum(p.numel() for n, p in model.named_parameters()
                     if not n.startswith("blocks.") and not (a.split and not a.tied))
    case = (f"vocab {a.vocab} hidden {a.hidden} {'tied' if a.tied else 'untied'} "
            f"{'split' if a.split else 'one root'} reduce {a.reduce}, root unit "
            f"{root_numel / 1e9:.2f} G params")
    try:
        ids_T = torch.randint(0, a.vocab, (1024,), device=dev)
        for _ in range(2):
            model(ids_T).backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        finite = all(bool(g.isfinite().all()) for g in grads)
        if dev == "cuda":
            torch.cuda.synchronize()
        if rank == 0:
            print(f"PROBE ok: {case}; gradients finite: {finite}", flush=True)
    except Exception as e:  # the point is to report any fault
        if rank == 0:
            print(f"PROBE FAIL: {case}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
