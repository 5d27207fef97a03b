"""Convergence, packed vs padded, on the same samples in the same steps.

    python bench/convergence.py --recipe qwen3-vl-2b --mode packed --out runs/conv-2b
    python bench/convergence.py --recipe qwen3-vl-2b --mode padded --out runs/conv-2b
    python bench/convergence.py --recipe qwen3-vl-2b --compare --out runs/conv-2b

The samples are planned once into bins of `--seq-len` tokens (the trainer's BinStream: seeded
shuffle, BFD over the recipe's buffer; overlong samples skipped). Step k trains on the samples of
bin k in both modes:
`packed` as one THD row (vlpack varlen attention), `padded` as right-padded batches of at most
`--micro` samples (sdpa), with the trainer's `optimizer_step` (global token-mean loss, the
recipe's AdamW, schedule, clipping, loss path and MoE aux coefficient; bf16 autocast on GPU, fp32
master weights). The two runs see the same samples with the same learning rate at every step, so
their loss curves differ only by numerics. (With MoE, the aux loss pools each micro-batch's real
tokens: the same tokens as the packed row only while a bin fits one padded micro-batch, i.e.
`--micro` ≥ samples per bin.) Each mode writes OUT/MODE/metrics.jsonl (`vlpack plot`
reads it); `--compare` writes the overlay PNG and the final-loss comparison (`--also NAME` adds a
further run under OUT, e.g. a second packed run: the run-to-run spread of one mode).

A run longer than one sitting: `--stop-after S` ends it after the first step that passes S
seconds and saves what the next sitting needs in OUT/MODE/resume.pt (the trainable parameters,
the optimizer, the schedule and the step; the frozen base is rebuilt from the seed). The same
command with `--resume` goes on from there and appends to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from vlpack.config import DataConfig, load_config
from vlpack.data.batch import build_thd_batch
from vlpack.data.encode import Encoder
from vlpack.data.loader import measure_all, open_dataset
from vlpack.data.padded import build_padded_batch
from vlpack.data.stream import BinStream
from vlpack.model.presets import get_preset
from vlpack.train.distributed.parallel import Topology
from vlpack.train.optim import build_optimizer, build_scheduler
from vlpack.train.run.plot import plot_runs
from vlpack.train.setup.stack import build_stack
from vlpack.train.step import optimizer_step


class StepBatches(torch.utils.data.Dataset):
    """Step k → the micro-batches of bin k for one mode (encoded in DataLoader workers)."""

    def __init__(self, items, encoder: Encoder, bins, mode: str, micro: int, spec,
                 d: DataConfig):
        self.items, self.encoder, self.bins = items, encoder, bins
        self.mode, self.micro, self.spec, self.after_video = mode, micro, spec, d.mrope_after_video

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, k: int) -> list:
        group = [self.encoder.encode(self.items[i]) for i in self.bins[k]]
        pad = self.spec.pad_token_id
        if self.mode == "packed":
            # no alignment padding, as `plan` planned the bins; the recipe's MRoPE rule
            return [build_thd_batch(group, pad_token_id=pad, pad_to_multiple_of=1,
                                    spatial_merge_size=self.spec.merge_size,
                                    mrope_after_video=self.after_video)]
        return [build_padded_batch(group[i : i + self.micro], pad_token_id=pad)
                for i in range(0, len(group), self.micro)]


def plan(sizes, seq_len: int, steps: int, seed: int, buffer: int) -> list[list[int]]:
    """The first `steps` bins of the trainer's stream over `sizes` (epochs chained)."""
    d = DataConfig(seq_len=seq_len, packing="bfd", buffer_size=buffer, overlong="skip",
                   pad_to_multiple_of=1, max_consecutive_bad=len(sizes), max_bad_fraction=1.0)
    stream = BinStream(sizes=sizes, data=d, seed=seed, epochs=None)
    bins = []
    for b in stream:
        bins.append(list(b.items))
        if len(bins) == steps:
            return bins
    raise AssertionError("an endless stream ended")


def trainable_state(module: torch.nn.Module) -> dict:
    """The parameters that get gradients (the frozen base is rebuilt from the seed)."""
    return {n: p.detach().cpu() for n, p in module.named_parameters() if p.requires_grad}


def train(args, cfg, items, encoder, bins, device) -> Path:
    """`args.mode`'s run over `bins`, built by the trainer's stack builder (LoRA, frozen bf16
    base, checkpointing and compile as the recipe says), one GPU or CPU."""
    topo = Topology(rank=0, world_size=1, local_rank=0, device=device)
    stack = build_stack(cfg, topo)
    module, spec = stack.module, stack.spec
    opt = build_optimizer(module.parameters(), cfg.optim, device_type=device.type)
    sched = build_scheduler(opt, cfg.optim, len(bins))
    run = Path(args.out) / args.mode
    run.mkdir(parents=True, exist_ok=True)
    resume = run / "resume.pt"
    done, seen, before = 0, 0, 0.0
    if args.resume:
        if not resume.is_file():
            raise ValueError(f"--resume: {resume} does not exist; run without --resume first")
        state = torch.load(resume, map_location=device)
        missing = set(trainable_state(module)) ^ set(state["trainable"])
        assert not missing, f"resume.pt names other trainable parameters: {sorted(missing)[:4]}"
        with torch.no_grad():
            for n, p in module.named_parameters():
                if p.requires_grad:
                    p.copy_(state["trainable"][n])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        done, seen, before = state["step"], state["samples"], state["seconds"]
        rows = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text("".join(r + "\n" for r in rows[:done]))
        print(f"{args.mode}: resumed after step {done}", flush=True)
    data = torch.utils.data.DataLoader(
        StepBatches(items, encoder, bins[done:], args.mode, args.micro, spec, cfg.data),
        batch_size=None,
        num_workers=args.workers, prefetch_factor=4 if args.workers else None,
        pin_memory=device.type == "cuda", collate_fn=lambda x: x)
    t0 = time.perf_counter() - before
    with open(run / "metrics.jsonl", "a" if done else "w") as f:
        for k, mbs in enumerate(data, done + 1):
            mbs = [b.to(device, non_blocking=True) for b in mbs]
            r = optimizer_step(module, opt, sched, mbs, topo=topo, aux_coef=cfg.train.aux_loss_coef,
                               grad_clip=cfg.optim.grad_clip, autocast=stack.autocast)
            seen += r.samples
            row = {"step": k, "loss": r.loss, "aux_loss": r.aux_loss, "samples": seen,
                   "lr": r.lr, "grad_norm": r.grad_norm, "seconds": time.perf_counter() - t0}
            f.write(json.dumps(row) + "\n")
            f.flush()
            if k % 25 == 0 or k == len(bins):
                print(f"{args.mode} step {k}/{len(bins)} loss {r.loss:.4f} "
                      f"({row['seconds']:.0f} s)", flush=True)
            if args.stop_after and time.perf_counter() - t0 - before > args.stop_after \
                    and k < len(bins):
                torch.save({"trainable": trainable_state(module), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": k, "samples": seen,
                            "seconds": row["seconds"]}, resume)
                print(f"{args.mode}: stopped after step {k}; go on with --resume", flush=True)
                return run
    resume.unlink(missing_ok=True)
    return run


STRETCHES = (25, 50, 100, 150, 200)
"""Last steps of the stretches over which `compare` reports the mean relative loss gap."""


def compare(out: Path, tail: int, also: tuple[str, ...] = ()) -> dict:
    """Overlay PNG (loss, and the MoE aux loss and gradient norm where recorded), the final
    losses (mean of the last `tail` steps) and the mean relative loss gap per stretch of steps
    (`STRETCHES`) of both modes; `also` names further runs under `out` (e.g. a repeat of one
    mode), overlaid and compared with each mode too. Each gap is (a − b) / b of the pair a/b."""
    names = ["packed", "padded", *also]
    if len(set(names)) != len(names):
        raise ValueError(f"--also {' '.join(also)}: packed and padded are compared already; "
                         "name other runs")
    missing = [n for n in names if not (out / n / "metrics.jsonl").is_file()]
    if missing:
        raise ValueError(f"no {', '.join(str(out / n / 'metrics.jsonl') for n in missing)}: "
                         "run that mode (or copy that run) into OUT first")
    runs = [out / n for n in names]
    rows = {r.name: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]
            for r in runs}
    metrics = ["loss"] + [m for m in ("aux_loss", "grad_norm")
                          if all(v[0].get(m) is not None for v in rows.values())]
    steps = min(len(v) for v in rows.values())
    final = {m: sum(x["loss"] for x in v[steps - tail : steps]) / tail for m, v in rows.items()}

    def mean(name: str, lo: int, hi: int) -> float:
        xs = [r["loss"] for r in rows[name][lo:hi]]
        return sum(xs) / len(xs)

    pairs = [("packed", "padded"), *((a, b) for a in also for b in ("packed", "padded"))]
    bounds = [0, *(s for s in STRETCHES if s < steps), steps]
    stretch = {f"{a}/{b}": {f"{lo + 1}-{hi}": (mean(a, lo, hi) - mean(b, lo, hi)) / mean(b, lo, hi)
                            for lo, hi in itertools.pairwise(bounds)} for a, b in pairs}
    res = {
        "steps": steps, "samples": rows["packed"][steps - 1]["samples"],
        "final_loss_mean_last": tail, "final_loss": final,
        "relative_difference": abs(final["packed"] - final["padded"]) / final["padded"],
        "max_step_abs_difference": max(abs(a["loss"] - b["loss"]) for a, b in
                                       zip(rows["packed"][:steps], rows["padded"][:steps], strict=True)),
        "relative_gap_by_stretch": stretch,
        "wall_s": {m: v[steps - 1]["seconds"] for m, v in rows.items()},
        "png": str(plot_runs(runs, out / "convergence.png", metrics=metrics)),
    }
    if also:
        res["relative_difference_of"] = {f"{a}/{b}": abs(final[a] - final[b]) / final[b]
                                         for a, b in pairs[1:]}
    (out / "convergence.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default="tiny", help="recipe name or YAML (model, optim, seed)")
    p.add_argument("--mode", choices=("packed", "padded"))
    p.add_argument("--compare", action="store_true", help="plot and compare OUT/packed, OUT/padded")
    p.add_argument("--layers", type=int, default=None, help="reduce text depth (big MoE shapes)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro", type=int, default=8, help="padded: samples per micro-batch")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers that encode")
    p.add_argument("--tail", type=int, default=20, help="final loss = mean of the last N steps")
    p.add_argument("--also", action="append", default=[],
                   help="--compare: a further run OUT/NAME (metrics.jsonl) to overlay, repeatable")
    p.add_argument("--out", required=True)
    p.add_argument("--stop-after", type=float, default=0,
                   help="save OUT/MODE/resume.pt and stop after the first step past S seconds")
    p.add_argument("--resume", action="store_true", help="go on from OUT/MODE/resume.pt")
    p.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.compare:
        print(json.dumps(compare(out, args.tail, tuple(args.also)), indent=1))
        return 0
    if args.mode is None:
        p.error("pass --mode packed|padded, or --compare")
    if args.also:
        p.error("--also goes with --compare")
    mode = ["data.packing=none"] if args.mode == "padded" else []
    cut = ([f"model.name={get_preset(load_config(args.recipe).model.name).name}-{args.layers}L"]
           if args.layers else [])
    cfg = load_config(args.recipe, [*args.overrides, *cut, *mode,
                                    f"train.output_dir={out / args.mode}",
                                    f"train.kernel_cache={out / 'kernel_cache'}"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    encoder = Encoder.from_config(DataConfig(), get_preset(cfg.model.name).family, None)
    items = open_dataset("synthetic", None, synthetic_samples=args.samples)
    bins = plan(measure_all(items, encoder), args.seq_len, args.steps, cfg.train.seed,
                cfg.data.buffer_size)
    used = len({i for b in bins for i in b})
    print(f"{args.mode}: {args.steps} steps over {used} distinct samples "
          f"({sum(map(len, bins))} sample-steps; dataset {len(items)})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        (out / f"command_{args.mode}.txt").write_text("python " + " ".join(sys.argv) + "\n")
    train(args, cfg, items, encoder, bins, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
