"""Per-rank activation memory of one long packed row under context parallelism (CPU, gloo).

    python bench/context_memory.py --model tiny-qwen3_vl --tokens 8192 --cp 1 2 4

For each cp, `cp` processes split the same row (text-only samples of --sample-len tokens) and
each counts the bytes autograd saves for backward in one forward (saved-tensor hooks, each
storage once): what activation memory holds on that rank. Parameters are not counted; the
loss is the trainer's chunked one (its logits recomputed in backward).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import numpy as np
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(spec, tokens: int, sample_len: int):
    from vlpack.data.batch import build_thd_batch
    from vlpack.data.types import EncodedSample

    rng = np.random.default_rng(0)
    samples = []
    for i in range(tokens // sample_len):
        ids = rng.integers(0, 1000, sample_len).astype(np.int64)
        labels = ids.copy()
        labels[: sample_len // 2] = -100
        samples.append(EncodedSample(key=f"s{i}", input_ids=ids, labels=labels,
                                     mm_token_type_ids=np.zeros(sample_len, np.int8),
                                     image_grid_thw=np.zeros((0, 3), np.int64), pixel_values=None))
    return build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=16,
                           spatial_merge_size=spec.merge_size, mrope_after_video="transformers")


def _worker(rank: int, cp: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    from vlpack.model import build_model, packed_forward
    from vlpack.model.context import ContextGroup

    torch.set_num_threads(1)
    context = None
    if cp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp)
        context = ContextGroup(dist.group.WORLD, rank, cp)
    torch.manual_seed(0)
    model, spec = build_model(args.model, device="cpu", dtype=torch.float32)
    batch = _row(spec, args.tokens, args.sample_len)
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.grad_fn is None):
            return t  # a leaf: a parameter, not an activation
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = packed_forward(model, batch, spec=spec, loss_method="chunked", context=context)
    out.loss_sum.backward()
    queue.put((rank, total[0], batch.num_tokens))
    if cp > 1:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3_vl")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--sample-len", type=int, default=2048)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for cp in args.cp:
        queue, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_worker, args=(r, cp, port, args, queue)) for r in range(cp)]
        for proc in procs:
            proc.start()
        got = sorted(queue.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join()
        per_rank = [b for _, b, _ in got]
        rows.append(dict(cp=cp, tokens=got[0][2], saved_mib_per_rank=[b / 2**20 for b in per_rank]))
        base = rows[0]["saved_mib_per_rank"][0]
        print(f"cp={cp}: {got[0][2]} tokens, saved for backward per rank "
              + ", ".join(f"{b / 2**20:.1f}" for b in per_rank)
              + f" MiB (max {max(per_rank) / 2**20 / base:.2f}× cp=1)", flush=True)
    print(json.dumps(dict(model=args.model, rows=rows, command=" ".join(sys.argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
