"""Bin-planning speed and fill efficiency on receipt-like sample sizes (CPU, pure Python).

(a) Throughput: N lengths through `OnlinePlanner(capacity, algo, buffer)` by `push` one at a
    time and by `extend` in chunks of the buffer size, with one budget (tokens) and with two
    (tokens + ViT patches); plus the offline functions over all N at once. Best of --repeats.
(b) Fill efficiency (real tokens / (bins × capacity)) for several buffer sizes: the online
    planner with carry-over against a flush-every-buffer reference.
(c) Per input size: one `plan_bins` call over n lengths for each n in --sizes (a buffer, a
    large buffer, a whole dataset), calls repeated until each timing covers ≥ 0.2 s.

Sizes come from a parametric model of vlpack's synthetic receipts (not from encoding them):
text ~ U[150, 600] tokens; 0 / 1 / 2 images with p = 0.15 / 0.70 / 0.15, each image
log-uniform in [100, 2000] tokens; 4 ViT patches per image token (2×2 merge). Mean ≈ 1,010
tokens and ≈ 2,540 patches per sample (the encoder measured 909-1,105 and 2,477-3,232).

    python bench/plan_speed.py                    # all three sections, as tables
    python bench/plan_speed.py --section sizes    # one section (one process per section)
    python bench/plan_speed.py --json             # one JSON object
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from vlpack.data.plan import ALGOS, OnlinePlanner, bin_stats, plan_bins


def receipt_sizes(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(tokens, patches) per sample from the parametric receipt model in the module docstring."""
    rng = np.random.default_rng(seed)
    text = rng.integers(150, 601, n)
    n_img = rng.choice(3, size=n, p=[0.15, 0.70, 0.15])
    img = np.exp(rng.uniform(np.log(100), np.log(2000), (n, 2))).astype(np.int64)
    img_tokens = (img * (np.arange(2) < n_img[:, None])).sum(1)
    return (text + img_tokens).tolist(), (4 * img_tokens).tolist()


def _best(fn, repeats: int) -> float:
    """Fewest CPU seconds of this process over `repeats` runs (steadier than wall time on a
    shared machine; the planner is single-threaded pure Python)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def throughput(args, lens, pats) -> list[dict]:
    n, cap, buf = len(lens), args.capacity, args.buffer
    rows = []

    def by_push(algo, max_p):
        def go():
            pl = OnlinePlanner(cap, algo, buf, max_patches=max_p)
            push = pl.push
            for i in range(n):
                push(i, lens[i], pats[i])
            pl.flush()

        return go

    def by_extend(algo, max_p):
        def go():
            pl = OnlinePlanner(cap, algo, buf, max_patches=max_p)
            for s in range(0, n, buf):
                pl.extend(range(s, min(s + buf, n)), lens[s : s + buf], pats[s : s + buf])
            pl.flush()

        return go

    def offline(algo, max_p):
        return lambda: plan_bins(lens, cap, algo, patches=pats, max_patches=max_p)

    for algo in ALGOS:
        for mode, make in (("push", by_push), ("extend", by_extend), ("offline", offline)):
            for max_p in (None, args.max_patches):
                dt = _best(make(algo, max_p), args.repeats)
                rows.append(
                    {
                        "algo": algo,
                        "mode": mode,
                        "budgets": "tokens" if max_p is None else f"tokens+patches≤{max_p}",
                        "seconds": round(dt, 3),
                        "lengths_per_s": round(n / dt),
                    }
                )
    return rows


def per_size(args, lens, pats) -> list[dict]:
    """Seconds per `plan_bins` call over the first n lengths, for each n in args.sizes."""
    rows = []
    for n in args.sizes:
        ls, ps = lens[:n], pats[:n]
        calls = max(1, 200_000 // n)
        for algo in ALGOS:
            for max_p in (None, args.max_patches):

                def go(algo=algo, max_p=max_p, ls=ls, ps=ps, calls=calls):
                    for _ in range(calls):
                        plan_bins(ls, args.capacity, algo, patches=ps, max_patches=max_p)

                dt = _best(go, args.repeats) / calls
                rows.append(
                    {
                        "n": n,
                        "algo": algo,
                        "budgets": "tokens" if max_p is None else f"tokens+patches≤{max_p}",
                        "ms_per_call": round(dt * 1e3, 3),
                        "lengths_per_s": round(n / dt),
                    }
                )
    return rows


def flush_every_buffer(lens, cap, algo, buf) -> list[list[int]]:
    bins = []
    for s in range(0, len(lens), buf):
        bins += [[s + i for i in b] for b in plan_bins(lens[s : s + buf], cap, algo)]
    return bins


def efficiency(args, lens) -> list[dict]:
    rows = []
    for algo in ALGOS:
        for buf in args.buffers:
            pl = OnlinePlanner(args.capacity, algo, buf, min_fill=args.min_fill)
            bins = pl.extend(range(len(lens)), lens) + pl.flush()
            ours = bin_stats(bins, lens, args.capacity)
            ref = bin_stats(flush_every_buffer(lens, args.capacity, algo, buf), lens, args.capacity)
            rows.append(
                {
                    "algo": algo,
                    "buffer": buf,
                    "carry_efficiency": round(ours["efficiency"], 5),
                    "carry_min_fill": round(ours["min_fill"], 3),
                    "flush_efficiency": round(ref["efficiency"], 5),
                    "flush_min_fill": round(ref["min_fill"], 3),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="lengths for throughput")
    ap.add_argument("--eff-n", type=int, default=200_000, help="lengths for efficiency")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--buffer", type=int, default=1024, help="buffer for throughput")
    ap.add_argument("--buffers", type=lambda s: [int(x) for x in s.split(",")],
                    default=[64, 256, 512, 1024])  # fmt: skip
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[256, 4096, 100_000], help="lengths per call for --section sizes")  # fmt: skip
    ap.add_argument(
        "--section",
        choices=["throughput", "efficiency", "sizes"],
        default=None,
        help="run one section only (default: all)",
    )
    ap.add_argument("--max-patches", type=int, default=32768)
    ap.add_argument("--min-fill", type=float, default=0.98)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = ap.parse_args()

    run = {args.section} if args.section else {"throughput", "efficiency", "sizes"}
    lens, pats = receipt_sizes(args.n, args.seed)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
        "n": args.n,
        "capacity": args.capacity,
        "buffer": args.buffer,
        "mean_tokens": round(sum(lens) / len(lens), 1),
        "mean_patches": round(sum(pats) / len(pats), 1),
        "throughput": throughput(args, lens, pats) if "throughput" in run else [],
        "efficiency": efficiency(args, lens[: args.eff_n]) if "efficiency" in run else [],
        "efficiency_n": min(args.eff_n, args.n),
        "min_fill": args.min_fill,
        "sizes": per_size(args, *receipt_sizes(max(args.sizes), args.seed)) if "sizes" in run else [],
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print_tables(args, result)


def print_tables(args, result: dict) -> None:
    if result["throughput"]:
        print(f"{args.n:,} lengths (mean {result['mean_tokens']} tokens, "
              f"{result['mean_patches']} patches), capacity {args.capacity}, "
              f"buffer {args.buffer}")  # fmt: skip
        print("\n| algo | mode | budgets | s | lengths/s |\n| --- | --- | --- | ---: | ---: |")
        for r in result["throughput"]:
            print(f"| {r['algo']} | {r['mode']} | {r['budgets']} | {r['seconds']:.2f} "
                  f"| {r['lengths_per_s']:,} |")  # fmt: skip
    if result["efficiency"]:
        print(f"\nfill efficiency, {result['efficiency_n']:,} lengths, min_fill {args.min_fill}")
        print("\n| algo | buffer | carry eff. | carry min fill | flush-every-buffer eff. "
              "| flush min fill |\n| --- | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip
        for r in result["efficiency"]:
            print(f"| {r['algo']} | {r['buffer']} | {r['carry_efficiency']:.2%} "
                  f"| {r['carry_min_fill']:.3f} | {r['flush_efficiency']:.2%} "
                  f"| {r['flush_min_fill']:.3f} |")  # fmt: skip
    if result["sizes"]:
        print(f"\none plan_bins call per size, capacity {args.capacity}")
        print("\n| n | algo | budgets | ms/call | lengths/s |\n| ---: | --- | --- | ---: | ---: |")
        for r in result["sizes"]:
            print(f"| {r['n']:,} | {r['algo']} | {r['budgets']} | {r['ms_per_call']:.3f} "
                  f"| {r['lengths_per_s']:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
