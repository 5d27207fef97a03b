"""bench/convergence_spread.py on hand-worked loss curves: each seed's gap over the steps both
modes reached, and a repeat against its seed over the steps both runs reached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import bench_module


def _run(path: Path, losses: list[float]) -> None:
    path.mkdir(parents=True)
    rows = [json.dumps({"step": i + 1, "loss": x}) for i, x in enumerate(losses)]
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def test_spread_windows(tmp_path, capsys):
    convergence_spread = bench_module("convergence_spread")
    _run(tmp_path / "s0" / "packed", [4, 3, 2, 1])
    _run(tmp_path / "s0" / "padded", [4, 3, 2, 2, 100])  # step 5: beyond the packed run's last
    _run(tmp_path / "s1" / "packed", [5, 4, 3, 2])
    _run(tmp_path / "s1" / "padded", [5, 4, 3, 2])
    _run(tmp_path / "s0r" / "packed", [4, 3, 3, 9, 9])
    convergence_spread.main([str(tmp_path / "s0"), str(tmp_path / "s1"),
                             "--repeat", str(tmp_path / "s0r"), "--tail", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s0, s1 = out["runs"][:2]
    # s0: packed (2 + 1) / 2 = 1.5, padded (2 + 2) / 2 = 2 over steps 3-4 → -25%
    assert (s0["packed"], s0["padded"], s0["gap"]) == (1.5, 2.0, -0.25)
    assert s1["gap"] == 0.0
    assert out["gap_mean"] == pytest.approx(-0.125)
    assert out["gap_sd"] == pytest.approx(0.25 / 2**0.5)
    # the repeat over steps 3-4: (3 + 9) / 2 = 6 against 1.5 → +300%
    assert out["repeat_s0r"] == {"packed": {"gap": pytest.approx(3.0), "steps": 4}}


def test_a_repeat_of_a_seed_outside_the_table(tmp_path, capsys):
    """s0's pair is too short for --tail, so s0 is not a seed of the table; its packed run is
    still the repeat's reference (the folder beside s0r)."""
    convergence_spread = bench_module("convergence_spread")
    _run(tmp_path / "s0" / "packed", [4, 3, 2, 2])
    _run(tmp_path / "s0" / "padded", [4])
    _run(tmp_path / "s1" / "packed", [5, 4, 3, 2])
    _run(tmp_path / "s1" / "padded", [5, 4, 3, 4])
    _run(tmp_path / "s0r" / "packed", [4, 3, 3, 5])
    convergence_spread.main([str(tmp_path / "s1"), "--repeat", str(tmp_path / "s0r"),
                             "--tail", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # s1 over steps 3-4: packed 2.5, padded 3.5; the repeat (3 + 5) / 2 = 4 against 2 → +100%
    assert out["runs"][0]["gap"] == pytest.approx(2.5 / 3.5 - 1)
    assert out["repeat_s0r"] == {"packed": {"gap": pytest.approx(1.0), "steps": 4}}
