"""The packed/padded gap of bench/convergence.py against the spread between runs.

    python bench/convergence_spread.py OUT/s0 OUT/s1 OUT/s2 --repeat OUT/s0r --tail 20

Each folder holds one `packed/` and one `padded/` run of the same seed (`train.seed`: the same
initial weights and the same samples in the same steps for both modes). Per seed: the final loss
(mean of the last `--tail` steps both modes reached) of each mode and their signed relative gap
(packed − padded) / padded. Across seeds: the gaps' mean and standard deviation. `--repeat`
names a folder that ran a seed again (one mode or both): its runs against that seed's give the
within-mode spread of a repeat (non-deterministic kernels), the floor a packing defect must
exceed to show; a repeat and its seed's run are compared over the same `--tail` steps, ending at
the last step both reached. The seed's folder is the one beside the repeat named without its
last letter (s0r repeats s0), a seed of the table or not (one whose pair is too short for
`--tail` need not be). Prints a markdown table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

MODES = ("packed", "padded")


def losses(run: Path) -> list[float]:
    """The per-step losses of one run's metrics.jsonl."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def tail_mean(curve: list[float], tail: int, upto: int, run: Path) -> float:
    """The mean loss of `run`'s `tail` steps ending at step `upto`."""
    if upto < tail:
        raise ValueError(f"{run}: {upto} steps, fewer than --tail {tail}")
    return sum(curve[upto - tail:upto]) / tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seeds", nargs="+", type=Path, help="folders with packed/ and padded/")
    p.add_argument("--repeat", type=Path, action="append", default=[],
                   help="a folder that ran the seed of the folder beside it named without its "
                        "last letter again (s0r repeats s0)")
    p.add_argument("--tail", type=int, default=20)
    args = p.parse_args(argv)
    rows, gaps, curves = [], [], {}
    print("| run | steps | packed | padded | (packed − padded) / padded |")
    print("|---|---:|---:|---:|---:|")
    for folder in args.seeds + args.repeat:
        modes = [m for m in MODES if folder in args.seeds or (folder / m / "metrics.jsonl").is_file()]
        if not modes:
            raise ValueError(f"{folder}: no packed/ or padded/ run")
        curves |= {folder / m: losses(folder / m) for m in modes}
        n = min(len(curves[folder / m]) for m in modes)
        row = dict(run=folder.name, steps=n,
                   **{m: tail_mean(curves[folder / m], args.tail, n, folder / m) for m in modes})
        cells = [f"{row[m]:.4f}" if m in row else "—" for m in MODES]
        if len(modes) == 2:
            row["gap"] = (row["packed"] - row["padded"]) / row["padded"]
            gaps += [row["gap"]] if folder in args.seeds else []
        rows.append(row)
        gap = f"{100 * row['gap']:+.2f}%" if "gap" in row else "—"
        print(f"| {folder.name} | {row['steps']} | {' | '.join(cells)} | {gap} |")
    out = dict(tail=args.tail, runs=rows, gap_mean=statistics.fmean(gaps),
               gap_sd=statistics.stdev(gaps) if len(gaps) > 1 else None)
    for rep in args.repeat:
        base = rep.parent / rep.name[:-1]
        spread = {}
        for m in MODES:
            if rep / m in curves:
                if base / m not in curves:
                    curves[base / m] = losses(base / m)
                a, b = curves[base / m], curves[rep / m]
                n = min(len(a), len(b))
                a, b = tail_mean(a, args.tail, n, base / m), tail_mean(b, args.tail, n, rep / m)
                spread[m] = {"gap": (b - a) / a, "steps": n}
        out[f"repeat_{rep.name}"] = spread
    sd = "—" if out["gap_sd"] is None else f"{100 * out['gap_sd']:.2f}%"
    print(f"\ngap over {len(gaps)} seeds: mean {100 * out['gap_mean']:+.2f}%, sd {sd}")
    for rep in args.repeat:
        r = out[f"repeat_{rep.name}"]
        print(f"{rep.name} against {rep.name[:-1]}: " + ", ".join(
            f"{m} {100 * v['gap']:+.2f}% (steps {v['steps'] - args.tail + 1}–{v['steps']})"
            for m, v in r.items()))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
