"""Paired step times of runs that trained the same bins in the same order: a developer tool for the
A/Bs of tools/h200_session.sh's `ab` part, not part of vlpack.

    python3 tools/ab_steps.py RUN_DIR [RUN_DIR ...]

Each RUN_DIR holds a `vlpack train` run's metrics.jsonl; its side is the last character of its
name (`1-a`, `2-b`, ...). Prints each step's time in every run, and per step the ratio of side b's
mean to side a's (below 1: b is faster), then the median of those ratios over the steps from 2 on
(step 1 compiles). Steps are paired, not pooled: with the same bins, a step's time depends on its
bin's samples as much as on the code, and alternating the sides' order (a b b a) spreads what a
machine's first process pays over both.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def step_times(run: Path) -> dict[int, float]:
    """{step: seconds} of a run folder's training rows (none where it has no metrics; a line cut
    short by a killed run is left out)."""
    file = run / "metrics.jsonl"
    rows = []
    for line in (file.read_text().splitlines() if file.is_file() else []):
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return {r["step"]: r["step_s"] for r in rows if "loss" in r and "step_s" in r}


def main(argv: list[str]) -> int:
    runs = [Path(a) for a in argv]
    if not runs:
        print(__doc__)
        return 2
    times = {run: t for run in runs if (t := step_times(run))}
    sides = {run: run.name[-1] for run in times}
    others = [run.name for run in times if sides[run] not in "ab"]
    if others:
        print("not side a or b (left out of the ratios):", ", ".join(others))
    steps = sorted(set.intersection(*(set(t) for t in times.values()))) if times else []
    print("step  " + "  ".join(f"{run.name:>8}" for run in times) + "     b/a")
    ratios = []
    for step in steps:
        by = {s: [times[run][step] for run in times if sides[run] == s] for s in "ab"}
        ratio = (statistics.mean(by["b"]) / statistics.mean(by["a"])) if by["a"] and by["b"] else None
        if ratio is not None and step >= 2:
            ratios.append(ratio)
        cells = "  ".join(f"{times[run][step]:8.3f}" for run in times)
        print(f"{step:4d}  {cells}  " + (f"{ratio:6.3f}" if ratio is not None else "     -"))
    missing = [run.name for run in runs if run not in times]
    if missing:
        print("no metrics:", ", ".join(missing))
    if steps and len({len(t) for t in times.values()}) > 1:
        print(f"steps compared: those every run reached (1-{steps[-1]})")
    if ratios:
        print(f"median b/a over steps 2-{steps[-1]}: {statistics.median(ratios):.3f} "
              f"({sum(r < 1 for r in ratios)} of {len(ratios)} steps faster on b)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
