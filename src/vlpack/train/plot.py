"""Loss curves: the PNG written at the end of a run, and `vlpack plot` overlaying runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlpack.train.metrics import read_metrics


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, x: str = "samples") -> Path:
    """Overlay the training loss of runs against samples seen (or `step`); eval loss dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for run in run_dirs:
        rows = read_metrics(run)
        xs = [r.get(x, r["step"]) for r in rows if r.get("loss") is not None]
        ys = [r["loss"] for r in rows if r.get("loss") is not None]
        (line,) = ax.plot(xs, ys, label=Path(run).name, lw=1.4)
        ev = [(r.get(x, r["step"]), r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
        if ev:
            ax.plot(*zip(*ev, strict=True), ls="--", marker="o", ms=3, color=line.get_color(),
                    label=f"{Path(run).name} (eval)")
    ax.set_xlabel("samples seen" if x == "samples" else x)
    ax.set_ylabel("loss (token mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_command(args: argparse.Namespace) -> int:
    out = args.out or Path(args.runs[0]) / "loss_overlay.png"
    print(f"wrote {plot_runs(args.runs, out)}")
    return 0
