"""A training run over a mixture (data.mix) reports what it trained from each source."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import CPU, small_cfg
from vlpack.train.loop import Trainer
from vlpack.train.metrics import format_summary


def test_run_reports_samples_per_source(tmp_path: Path) -> None:
    cfg = small_cfg(tmp_path, "train.max_steps=2", "train.log_every=1",
                    "data.mix=[{source: synthetic, weight: 3, name: receipts}, "
                    "{source: synthetic, weight: 1, name: more}]")
    trainer = Trainer(cfg, CPU)
    summary = trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "sources" in r][-1]
    assert summary["sources"] == last["sources"]
    assert summary["sources"] and set(summary["sources"]) <= {"receipts", "more"}
    assert sum(summary["sources"].values()) == summary["samples"]
    assert "sources" in format_summary({**summary, "metrics": "m", "plot": None})
