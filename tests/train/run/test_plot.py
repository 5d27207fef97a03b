"""`vlpack plot`: the panels asked for with --metrics, drawn from metrics.jsonl rows."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from tests.helpers import CPU, small_cfg
from vlpack.cli import main
from vlpack.train.run.plot import plot_runs
from vlpack.train.trainer import Trainer


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


# --- without matplotlib (an extra: vlpack[plot]) -----------------------------------------------------
def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch, capsys) -> None:
    run = _run(tmp_path / "a", ROWS)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ValueError, match=r"needs matplotlib: pip install 'vlpack\[plot\]'"):
        plot_runs([run], tmp_path / "p.png")
    assert main(["plot", str(run)]) == 2
    assert "pip install 'vlpack[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_training_without_matplotlib_skips_the_plot(tmp_path: Path, monkeypatch, caplog) -> None:
    """A run ends without loss.png, with one log line and the summary's plot line saying how
    to get it."""
    from vlpack.train.run.metrics import format_summary

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.INFO, logger="vlpack"):
        summary = Trainer(small_cfg(tmp_path / "run", "train.max_steps=1"), CPU).fit()
    assert summary["plot"] is None and not (tmp_path / "run" / "loss.png").exists()
    said = [r.getMessage() for r in caplog.records if "vlpack[plot]" in r.getMessage()]
    assert said == ["no loss.png: matplotlib is not installed: pip install 'vlpack[plot]'"]
    plot_line = [ln for ln in format_summary(summary).splitlines() if ln.strip().startswith("plot")]
    assert plot_line == ["  plot        no loss.png: matplotlib is not installed: "
                         "pip install 'vlpack[plot]'"]
