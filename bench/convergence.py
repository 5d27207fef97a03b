"""Convergence, packed vs padded, on the same samples in the same steps.

    python bench/convergence.py --recipe qwen3-vl-2b --mode packed --out runs/conv-2b
    python bench/convergence.py --recipe qwen3-vl-2b --mode padded --out runs/conv-2b
    python bench/convergence.py --recipe qwen3-vl-2b --compare --out runs/conv-2b

Each mode builds the trainer (`Trainer`: the recipe's model stack, encoder, optimizer and
schedule over `--steps`) on `--samples` of the built-in synthetic set, planned into bins of
`--seq-len` tokens by the recipe's data section (the trainer's BinStream: seeded shuffle, its
planner over its buffer; overlong samples skipped, no held-out split). Step k trains on the
samples of the step's `train.micro_batches` bins in both modes: `packed` on the rows
`build_loaders` gives the trainer (THD, vlpack varlen attention), `padded` on the same bins as
right-padded batches of at most `--micro` samples (sdpa), each through the trainer's own step
(`Trainer.train_step`: global token-mean loss, clipping, the MoE aux coefficient; bf16 autocast
on GPU, fp32 master weights). The two runs see the same samples with the same learning rate at
every step (the packed run checks its rows against the plan), so their loss curves differ only
by numerics. (With MoE, the aux loss pools each micro-batch's real tokens: the same tokens as
the packed row only while a bin fits one padded micro-batch, i.e. `--micro` ≥ samples per bin.)
Each mode writes OUT/MODE/metrics.jsonl (`vlpack plot` reads it); `--compare` writes the
overlay PNG and the final-loss comparison (`--also NAME` adds a further run under OUT, e.g. a
second packed run: the run-to-run spread of one mode).

A run longer than one sitting: `--stop-after S` ends it after the first step that passes S
seconds and saves what the next sitting needs in OUT/MODE/resume.pt (the trainable parameters,
the optimizer, the schedule and the step; the frozen base is rebuilt from the seed). The same
command with `--resume` goes on from there and appends to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from vlpack.config import Config, DataConfig, load_config
from vlpack.data.padded import build_padded_batch
from vlpack.data.stream import BinStream
from vlpack.model.presets import get_preset
from vlpack.train.distributed.parallel import Topology
from vlpack.train.run.plot import plot_runs
from vlpack.train.trainer import Trainer


def bench_config(args, *extra: str, workers: int = 0) -> Config:
    """The recipe with the bench's data: `--samples` synthetic samples in bins of `--seq-len`,
    overlong ones skipped (not counted against the run), none held out, `workers` processes
    encoding; `extra` overrides last."""
    cut = ([f"model.name={get_preset(load_config(args.recipe).model.name).name}-{args.layers}L"]
           if args.layers else [])
    return load_config(args.recipe, [
        *args.overrides, *cut, "data.source=synthetic", f"data.synthetic_samples={args.samples}",
        f"data.seq_len={args.seq_len}", "data.overlong=skip", "data.eval_samples=0",
        "train.eval_generate_every=0", f"data.max_consecutive_bad={args.samples}",
        "data.max_bad_fraction=1.0", f"data.num_workers={workers}", "train.progress=false",
        *extra])


def padded_overrides(packed: Config) -> list[str]:
    """The padded mode's overrides of the packed run's config: the trainer's padded path. Its
    memory plan (data.batch_size rows) is not the bench's (--micro samples per batch), so a
    plan that does not fit is said, not refused, and never shortens the bins (the packed
    run's); `model.checkpoint_share=auto`, which plans packed rows, becomes every layer
    recomputed (recomputation changes no result); and the padded step runs eager (its padded
    lengths change every step, and the compiled step recompiles for them: on an H100 the
    12-layer cut made no step in 200 s)."""
    share = ["model.checkpoint_share=1.0"] if packed.model.checkpoint_share == "auto" else []
    return ["data.packing=none", "train.memory_check=warn", "model.compile=false", *share]


def plan(sizes, d: DataConfig, n: int, seed: int) -> list[list[int]]:
    """The first `n` bins of the trainer's stream over `sizes` under the data section `d`
    (epochs chained): the bins `build_loaders` gives a single rank, as sample indices."""
    if d.packing == "none":
        raise ValueError("the recipe trains padded (data.packing=none): pass a packed recipe "
                         "(--mode padded pads its bins)")
    bins = []
    for b in BinStream(sizes=sizes, data=d, seed=seed, epochs=None):
        bins.append(list(b.items))
        if len(bins) == n:
            return bins
    raise AssertionError("an endless stream ended")


class PaddedSteps(torch.utils.data.Dataset):
    """Step k → the right-padded micro-batches (at most `micro` samples each) of the bins of
    step k (encoded in DataLoader workers)."""

    def __init__(self, items, encoder, steps: list[list[list[int]]], micro: int, pad: int):
        self.items, self.encoder, self.steps, self.micro, self.pad = items, encoder, steps, micro, pad

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k: int) -> list:
        out = []
        for ids in self.steps[k]:
            group = [self.encoder.encode(self.items[i]) for i in ids]
            out += [build_padded_batch(group[i : i + self.micro], pad_token_id=self.pad)
                    for i in range(0, len(group), self.micro)]
        return out


def packed_steps(loader, items, steps: list[list[list[int]]], micro_batches: int):
    """Step k → the trainer's rows of step k (`build_loaders`), each checked against the plan:
    the padded run trains the same samples."""
    it = iter(loader)
    for k, bins in enumerate(steps):
        rows = [next(it) for _ in range(micro_batches)]
        for row, ids in zip(rows, bins, strict=True):
            if row.sample_keys != [items[i].key for i in ids]:
                raise AssertionError(f"step {k + 1}: the loader's row holds other samples than "
                                     "the plan the padded mode trains")
        yield rows


def trainable_state(module: torch.nn.Module) -> dict:
    """The parameters that get gradients (the frozen base is rebuilt from the seed)."""
    return {n: p.detach().cpu() for n, p in module.named_parameters() if p.requires_grad}


def train(args, trainer: Trainer, steps: list[list[list[int]]]) -> Path:
    """`args.mode`'s run over the bins of `steps` through `trainer` (its stack: LoRA, frozen
    bf16 base, checkpointing and compile as the recipe says; one GPU or CPU): the packed mode on
    the trainer's own rows, the padded mode on padded batches of the same bins."""
    module, opt, sched = trainer.module, trainer.optimizer, trainer.scheduler
    loader, m = trainer.train_loader, trainer.cfg.train.micro_batches
    run = Path(args.out) / args.mode
    run.mkdir(parents=True, exist_ok=True)
    resume = run / "resume.pt"
    done, seen, before = 0, 0, 0.0
    if args.resume:
        if not resume.is_file():
            raise ValueError(f"--resume: {resume} does not exist; run without --resume first")
        state = torch.load(resume, map_location=trainer.topo.device)
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
    if args.mode == "packed":
        loader.load_state_dict({"consumed": done * m})
        data = packed_steps(loader, loader.items, steps[done:], m)
    else:
        data = torch.utils.data.DataLoader(
            PaddedSteps(loader.items, trainer.encoder, steps[done:], args.micro,
                        trainer.spec.pad_token_id),
            batch_size=None, num_workers=args.workers,
            prefetch_factor=4 if args.workers else None,
            pin_memory=trainer.topo.device.type == "cuda", collate_fn=lambda x: x)
    t0 = time.perf_counter() - before
    with open(run / "metrics.jsonl", "a" if done else "w") as f:
        for k, mbs in enumerate(data, done + 1):
            r = trainer.train_step(mbs)
            seen += r.samples
            row = {"step": k, "loss": r.loss, "aux_loss": r.aux_loss, "samples": seen,
                   "lr": r.lr, "grad_norm": r.grad_norm, "seconds": time.perf_counter() - t0}
            f.write(json.dumps(row) + "\n")
            f.flush()
            if k % 25 == 0 or k == len(steps):
                print(f"{args.mode} step {k}/{len(steps)} loss {r.loss:.4f} "
                      f"({row['seconds']:.0f} s)", flush=True)
            if args.stop_after and time.perf_counter() - t0 - before > args.stop_after \
                    and k < len(steps):
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
    packed = bench_config(args)
    packing = packed.data.packing  # the padded mode plans the packed run's bins
    mode = padded_overrides(packed) if args.mode == "padded" else []
    cfg = bench_config(args, *mode, f"train.max_steps={args.steps}",
                       f"train.output_dir={out / args.mode}",
                       f"train.kernel_cache={out / 'kernel_cache'}", workers=args.workers)
    if cfg.train.tokens_per_step is not None:
        raise ValueError("train.tokens_per_step: a step's bins are not known ahead; the bench "
                         "plans train.micro_batches bins per step")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = Trainer(cfg, Topology(rank=0, world_size=1, local_rank=0, device=device))
    m = trainer.cfg.train.micro_batches  # as the memory plan left it
    loader = trainer.train_loader
    d = dataclasses.replace(trainer.cfg.data, packing=packing)
    bins = plan(loader.sizes, d, args.steps * m, cfg.train.seed)
    steps = [bins[k : k + m] for k in range(0, len(bins), m)]
    used = len({i for b in bins for i in b})
    print(f"{args.mode}: {args.steps} steps over {used} distinct samples "
          f"({sum(map(len, bins))} sample-steps; dataset {len(loader.items)})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        (out / f"command_{args.mode}.txt").write_text("python " + " ".join(sys.argv) + "\n")
    train(args, trainer, steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
