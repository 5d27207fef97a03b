"""This planner against a previous one, interleaved in one process (CPU, pure Python).

Loads `src/vlpack/data/plan/algorithms.py` as it was at --rev (default 7816db3, the last module
with separate paths for short and long inputs) from git and checks that both give the same bins
on bench/plan_speed.py's receipt lengths. Then, for each size, algorithm and budget, it times one
`plan_bins` call of each version, alternately (which goes first alternates too), and the same for
the core that the online planner runs (no input checks: `_plan_checked` here, `plan_lists`
there). A timing is `time.process_time` over enough calls to cover ≥ 0.05 s; the table has the
best ms per call of --repeats timings and new/old of the best (and of the medians). Alternating
in one process keeps the machine's load out of the ratio.

    python bench/plan_vs_previous.py                          # 256, 4,096 and 100,000 lengths
    python bench/plan_vs_previous.py --sizes 256 --repeats 31
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from plan_speed import receipt_sizes  # bench/, the script's folder, is on sys.path

from vlpack.data.plan import ALGOS, plan_bins
from vlpack.data.plan.algorithms import _plan_checked

ROOT = Path(__file__).resolve().parents[1]


def previous_module(rev: str) -> types.ModuleType:
    """The planner module at `rev`, loaded from git (it imports only the standard library)."""
    src = subprocess.run(
        ["git", "show", f"{rev}:src/vlpack/data/plan/algorithms.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    mod = types.ModuleType(f"plan_at_{rev}")
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"{rev}:algorithms.py", "exec"), mod.__dict__)
    return mod


def compare(old_fn, new_fn, repeats: int) -> tuple[float, float, float, float]:
    """(old best, new best, new/old of the bests, new/old of the medians), seconds per call."""
    t = time.process_time()
    old_fn()
    calls = max(1, int(0.05 / max(time.process_time() - t, 1e-6)))
    times: tuple[list[float], list[float]] = ([], [])
    fns = (old_fn, new_fn)
    for r in range(repeats):
        for v in (r % 2, 1 - r % 2):
            t = time.process_time()
            for _ in range(calls):
                fns[v]()
            times[v].append((time.process_time() - t) / calls)
    bo, bn = min(times[0]), min(times[1])
    return bo, bn, bn / bo, statistics.median(times[1]) / statistics.median(times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="7816db3")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[256, 4096, 100_000])  # fmt: skip
    ap.add_argument("--budgets", default="none,32768,16384", help="max_patches values")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=15, help="timings per version and case")
    args = ap.parse_args()
    budgets = [None if b == "none" else int(b) for b in args.budgets.split(",")]
    old = previous_module(args.rev)
    lens, pats = receipt_sizes(max(args.sizes))
    cap = args.capacity
    print(f"new/old, {args.repeats} alternating timings each; old = {args.rev}\n")
    print("| n | algo | max_patches | old ms | new ms | new/old | (medians) "
          "| core new/old | (medians) |")  # fmt: skip
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.sizes:
        ls, ps = lens[:n], pats[:n]
        for algo in ALGOS:
            for mp in budgets:
                kw = {"patches": ps, "max_patches": mp}
                bins = plan_bins(ls, cap, algo, **kw)
                assert bins == old.plan_bins(ls, cap, algo, **kw), f"bins differ: {n} {algo} {mp}"
                pp = None if mp is None else ps
                bo, bn, r, rm = compare(
                    lambda ls=ls, algo=algo, kw=kw: old.plan_bins(ls, cap, algo, **kw),
                    lambda ls=ls, algo=algo, kw=kw: plan_bins(ls, cap, algo, **kw),
                    args.repeats,
                )
                _, _, rc, rcm = compare(
                    lambda ls=ls, algo=algo, pp=pp, mp=mp: old.plan_lists(algo, ls, pp, cap, mp),
                    lambda ls=ls, algo=algo, pp=pp, mp=mp: _plan_checked(algo, ls, pp, cap, mp),
                    args.repeats,
                )
                print(f"| {n:,} | {algo} | {mp or '-'} | {bo * 1e3:.3f} | {bn * 1e3:.3f} "
                      f"| {r:.2f} | {rm:.2f} | {rc:.2f} | {rcm:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
