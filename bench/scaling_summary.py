"""Weak-scaling summary of `vlpack train` runs: steady-state figures from each metrics.jsonl.

    python bench/scaling_summary.py --skip 5 --out scaling.json \\
        1:runs/g1 2:runs/g2 4:runs/g4        # GPUS:RUN_DIR; the first entry is the baseline

Steady state = steps after the first `--skip` (compilation, allocator and cuDNN warm-up):
real tokens over summed step time. Efficiency = tokens/s per GPU over the baseline's per GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def steady(run: Path, skip: int) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    st = [r for r in rows if r["step"] > skip]
    if not st:
        raise ValueError(f"{run}/metrics.jsonl has no step after {skip}: lower --skip")
    secs = sum(r["step_s"] for r in st)
    return {
        "steps": len(rows), "real_tokens_per_s": sum(r["real_tokens"] for r in st) / secs,
        "real_tokens_per_step": sum(r["real_tokens"] for r in st) / len(st),
        "step_s": secs / len(st), "mfu": sum(r["mfu"] * r["step_s"] for r in st) / secs,
        "data_wait_s": sum(r["data_wait_s"] for r in st) / len(st),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in rows), "final_loss": rows[-1]["loss"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", help="GPUS:RUN_DIR (the first is the baseline)")
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    res, base = {}, None
    for spec in args.runs:
        gpus, _, path = spec.partition(":")
        r = steady(Path(path), args.skip)
        r["gpus"] = int(gpus)
        r["real_tokens_per_s_per_gpu"] = r["real_tokens_per_s"] / r["gpus"]
        base = base or r["real_tokens_per_s_per_gpu"]
        r["weak_scaling_efficiency"] = r["real_tokens_per_s_per_gpu"] / base
        res[Path(path).name] = r
        print(f"{Path(path).name:>24}: {r['gpus']} GPU  {r['real_tokens_per_s']:8.0f} tok/s  "
              f"{r['real_tokens_per_s_per_gpu']:7.0f}/GPU  {100 * r['weak_scaling_efficiency']:5.1f}%  "
              f"step {r['step_s']:.3f}s  MFU {100 * r['mfu']:.1f}%  peak {r['peak_mem_gib']:.1f} GiB")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
