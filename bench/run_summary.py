"""Side-by-side summary of `vlpack train` runs: final loss, speed, memory, and the curves.

    python bench/run_summary.py RUN [RUN ...] --reference RUN --out summary.json \
        [--png curves.png --metrics loss,aux_loss,grad_norm] [--tail 20] [--skip 3]

For each run folder (its metrics.jsonl): steps, the final loss (mean of the last --tail steps),
the median real tokens/s and MFU over the steps after the first --skip (compile, autotune), the
largest peak memory, and, against --reference, the relative difference of the final losses and
the largest per-step loss difference over their common steps. A run folder without
metrics.jsonl (it ran out of memory, or was cut off) is reported with its `error.txt` when
there is one. The PNG overlays --metrics, one panel each (`vlpack plot`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vlpack.train.run.metrics import read_metrics
from vlpack.train.run.plot import plot_runs


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(run: Path, tail: int, skip: int) -> dict:
    """One run's figures, or the reason it has none."""
    if not (run / "metrics.jsonl").exists():
        err = run / "error.txt"
        return {"error": err.read_text().strip()[:2000] if err.exists() else "no metrics.jsonl"}
    rows = [r for r in read_metrics(run) if r.get("loss") is not None]
    if not rows:
        return {"error": "metrics.jsonl has no step with a loss"}
    timed = rows[skip:] or rows
    peaks = [r["peak_mem_gib"] for r in rows if r.get("peak_mem_gib") is not None]
    last = rows[-tail:]
    return {
        "steps": len(rows),
        "final_loss": sum(r["loss"] for r in last) / len(last),
        "final_loss_mean_of_last": len(last),
        "real_tokens_per_s": _median(timed, "tokens_per_s"),
        "mfu": _median(timed, "mfu"),
        "peak_mem_gib": max(peaks) if peaks else None,
        "losses": [r["loss"] for r in rows],
    }


def compare(runs: dict[str, dict], reference: str) -> None:
    """Add each run's final-loss and per-step differences against `reference` (in place)."""
    ref = runs[reference]
    if "error" in ref:
        return
    for name, r in runs.items():
        if name == reference or "error" in r:
            continue
        n = min(len(r["losses"]), len(ref["losses"]))
        r["vs_reference"] = {
            "reference": reference,
            "final_loss_relative_difference": abs(r["final_loss"] - ref["final_loss"])
            / abs(ref["final_loss"]),
            "max_step_loss_abs_difference": max(
                abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n], strict=True)),
            "common_steps": n,
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--reference", type=Path, default=None, help="default: the first run")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--metrics", default="loss", help="the PNG's panels (comma list)")
    p.add_argument("--tail", type=int, default=20)
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the speed figures")
    p.add_argument("--command", default=None, help="the command that made the runs (recorded)")
    args = p.parse_args(argv)
    reference = (args.reference or args.runs[0]).name
    runs = {run.name: summarise(run, args.tail, args.skip) for run in args.runs}
    if reference not in runs:
        p.error(f"--reference {args.reference} is not one of the runs")
    compare(runs, reference)
    result = {"command": args.command, "runs": runs}
    plotted = [run for run in args.runs if "error" not in runs[run.name]]
    if args.png and plotted:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        result["png"] = str(plot_runs(plotted, args.png, x="step", metrics=metrics))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:>24}: {(r['error'].splitlines() or ['error'])[0]}")
            continue
        vs = r.get("vs_reference")
        print(f"{name:>24}: {r['steps']} steps, final loss {r['final_loss']:.4f}"
              + (f" ({100 * vs['final_loss_relative_difference']:.2f}% from {reference})" if vs else "")
              + f", {r['real_tokens_per_s'] or 0:,.0f} real tok/s"
              + (f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else "")
              + (f", peak {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
