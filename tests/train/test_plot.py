"""`vlpack plot`: the panels asked for with --metrics, drawn from metrics.jsonl rows."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from tests.helpers import CPU, small_cfg
from vlpack.cli import main
from vlpack.train.loop import Trainer
from vlpack.train.plot import plot_runs


def _run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


ROWS = [{"step": s, "samples": 4 * s, "loss": 3.0 - s, "lr": 1e-4 * s, "grad_norm": 0.5 * s,
         "tokens_per_s": 100.0 * s, "peak_mem_gib": 1.0 + s, "peak_reserved_gib": 2.0 + s}
        for s in (1, 2)]


def test_panels_for_lr_grad_norm_tokens_per_s_and_memory(tmp_path: Path, monkeypatch) -> None:
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to read its lines back
    run = _run(tmp_path / "a", ROWS)
    out = plot_runs([run], tmp_path / "p.png", metrics=["lr", "grad_norm", "tokens_per_s", "memory"])
    assert out.stat().st_size > 1000
    (fig,) = figs
    panels = {ax.get_ylabel(): {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()),
                                                 ln.get_linestyle()) for ln in ax.get_lines()}
              for ax in fig.axes}
    assert panels == {
        "learning rate": {"a": ([4, 8], [1e-4, 2e-4], "-")},
        "gradient norm": {"a": ([4, 8], [0.5, 1.0], "-")},
        "real tokens/s": {"a": ([4, 8], [100.0, 200.0], "-")},
        "peak memory (GiB)": {"a (peak allocated)": ([4, 8], [2.0, 3.0], "-"),
                              "a (peak reserved)": ([4, 8], [3.0, 4.0], ":")},
    }


def test_memory_of_a_cpu_run_is_refused_by_name(tmp_path: Path) -> None:
    run = _run(tmp_path / "cpu", [{**r, "peak_mem_gib": None, "peak_reserved_gib": None} for r in ROWS])
    with pytest.raises(ValueError, match=r"no run recorded 'memory' .*CPU runs no memory.*drop it"):
        plot_runs([run], tmp_path / "p.png", metrics=["loss", "memory"])


# --- vlpack plot over trained runs -------------------------------------------------------------------
def test_plot_overlays_runs(tmp_path: Path) -> None:
    for name in ("packed", "nopack"):
        packing = "bfd" if name == "packed" else "none"
        Trainer(small_cfg(tmp_path / name, "train.max_steps=2", f"data.packing={packing}"), CPU).fit()
    out = tmp_path / "overlay.png"
    assert main(["plot", str(tmp_path / "packed"), str(tmp_path / "nopack"), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    panels = tmp_path / "panels.png"
    assert main(["plot", str(tmp_path / "packed"), str(tmp_path / "nopack"), "--out", str(panels),
                 "--metrics", "loss,grad_norm", "--x", "step"]) == 0
    from PIL import Image

    # two panels stacked: taller than the one-panel figure at the same width
    assert Image.open(panels).size[1] > Image.open(out).size[1] * 1.5
    assert main(["plot", str(tmp_path / "missing")]) == 2
    # a dense model records no aux loss: refused with the metrics it does record
    assert main(["plot", str(tmp_path / "packed"), "--metrics", "aux_loss"]) == 2
