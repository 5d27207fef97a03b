"""Curves of runs: the loss PNG written at the end of a run, and `vlpack plot` overlaying runs
(the loss, and optionally the learning rate, the gradient norm, tokens/s, the device memory, the
MoE aux loss or any other per-step metric)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vlpack.train.run.metrics import read_metrics

LABELS = {"loss": "loss (token mean)", "aux_loss": "MoE aux loss", "grad_norm": "gradient norm",
          "tokens_per_s": "real tokens/s", "lr": "learning rate", "memory": "peak memory (GiB)",
          "peak_mem_gib": "peak allocated (GiB)", "peak_reserved_gib": "peak reserved (GiB)"}
PANELS = {"memory": ("peak_mem_gib", "peak_reserved_gib")}
"""Panels that draw several keys: `memory` = allocated (solid) and reserved (dotted)."""
PLOT_EXTRA = "pip install 'vlpack[plot]'"
"""How to get matplotlib, which draws the plots (an extra, not a core dependency)."""


def missing_matplotlib() -> str | None:
    """None where matplotlib imports, else a sentence saying how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed: {PLOT_EXTRA}"
    return None


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, x: str = "samples",
              metrics: Sequence[str] = ("loss",)) -> Path:
    """Overlay `metrics` of runs, one panel each, against samples seen (or `step`); the eval
    loss dashed on the loss panel. ValueError naming the metric when no run recorded it, or
    saying how to get matplotlib when it is missing."""
    if missing_matplotlib():
        raise ValueError(f"vlpack plot needs matplotlib: {PLOT_EXTRA} (or pip install matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {Path(run).name: read_metrics(run) for run in run_dirs}
    recorded = {k for rs in rows.values() for r in rs for k, v in r.items() if v is not None}
    for m in metrics:
        if not set(PANELS.get(m, (m,))) <= recorded:
            raise ValueError(f"no run recorded {m!r} (dense models have no aux_loss, CPU runs no "
                             f"memory): drop it from --metrics; these runs record {sorted(recorded)}")
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 3.2 * len(metrics) + 1.0), dpi=120,
                             sharex=True, squeeze=False)
    for ax, m in zip(axes[:, 0], metrics, strict=True):
        for name, rs in rows.items():
            line = None
            for key, style in zip(PANELS.get(m, (m,)), ("-", ":"), strict=False):
                pts = [(r.get(x, r["step"]), r[key]) for r in rs if r.get(key) is not None]
                if pts:
                    label = name if key == m else f"{name} ({LABELS[key].split(' (')[0]})"
                    (line,) = ax.plot(*zip(*pts, strict=True), ls=style, label=label, lw=1.4,
                                      color=line.get_color() if line else None)
            if line is None:
                continue
            ev = [(r.get(x, r["step"]), r["eval_loss"]) for r in rs
                  if m == "loss" and r.get("eval_loss") is not None]
            if ev:
                ax.plot(*zip(*ev, strict=True), ls="--", marker="o", ms=3, color=line.get_color(),
                        label=f"{name} (eval)")
        ax.set_ylabel(LABELS.get(m, m))
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1, 0].set_xlabel("samples seen" if x == "samples" else x)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
