"""Packed rows/s of the Energon loader against the JSONL loader, by worker count.

    python bench/energon_speed.py [--n 256] [--seq-len 8192] [--rows 24] [--workers 0 2 4]

Both loaders read the same synthetic receipts (written once, then prepared for Energon with
`prepare_energon`), pack with BFD over buffers of `--buffer` samples into rows of `--seq-len`
tokens, encode with the same `Encoder` and build the same `ThdBatch`. For each worker count the
first `--warmup` rows are discarded (startup: tokenizer, buffer fill, JSONL size measurement),
then `--rows` rows are timed (best of `--repeats`). `fill` = real tokens / (rows × seq_len).
Prints a Markdown table (`--json` for one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def _time(make: Callable[[], Iterable], rows: int, warmup: int, seq_len: int) -> dict:
    t0 = time.perf_counter()
    loader = make()
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    t_start = time.perf_counter() - t0
    t1 = time.perf_counter()
    real = samples = 0
    for _ in range(rows):
        b = next(it)
        real, samples = real + b.num_real_tokens, samples + b.num_samples
    dt = time.perf_counter() - t1
    close = getattr(it, "close", None) or getattr(loader, "close", None)
    if close:
        close()
    if hasattr(loader, "close"):
        loader.close()
    return {"startup_s": t_start, "rows_per_s": rows / dt, "samples_per_s": samples / dt,
            "real_tokens_per_s": real / dt, "fill": real / (rows * seq_len)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=256, help="synthetic samples")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--buffer", type=int, default=64, help="samples planned together")
    parser.add_argument("--rows", type=int, default=24, help="timed rows per run")
    parser.add_argument("--warmup", type=int, default=2, help="rows discarded per run")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting; best is kept")
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from vlpack.config import DataConfig
    from vlpack.data.encode import Encoder
    from vlpack.data.energon.loader import EnergonLoader
    from vlpack.data.energon.prepare import prepare_energon
    from vlpack.data.loader import PackedLoader, open_dataset
    from vlpack.data.synth import default_dataset

    enc = Encoder.from_config(DataConfig(), args.family, None)
    pad = enc.tokenizer.pad_token_id or 0
    src = default_dataset(n=args.n)
    common = dict(seq_len=args.seq_len, packing="bfd", pad_to_multiple_of=8, overlong="truncate",
                  buffer_size=args.buffer)  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        prepare_energon(src, Path(tmp) / "ds", shard_size=64)
        t_prepare = time.perf_counter() - t0
        for w in args.workers:
            for name, make in (
                ("jsonl", lambda w=w: PackedLoader(
                    open_dataset("jsonl", str(src)), enc, DataConfig(num_workers=w, **common),
                    seed=0, pad_token_id=pad)),
                ("energon", lambda w=w: EnergonLoader(
                    enc, DataConfig(source="energon", path=str(Path(tmp) / "ds"), num_workers=w,
                                    **common),
                    seed=0, pad_token_id=pad)),
            ):  # fmt: skip
                runs = [_time(make, args.rows, args.warmup, args.seq_len) for _ in range(args.repeats)]
                r = max(runs, key=lambda x: x["rows_per_s"])
                results.append({"loader": name, "workers": w, **r})
                if not args.json:
                    print(f"  {name:7s} workers={w}: {r['rows_per_s']:.2f} rows/s", flush=True)
    meta = {"n": args.n, "seq_len": args.seq_len, "buffer": args.buffer, "rows": args.rows,
            "family": args.family, "max_pixels": enc.max_pixels, "cores": os.cpu_count(),
            "prepare_s": t_prepare}  # fmt: skip
    if args.json:
        print(json.dumps({**meta, "results": results}, indent=2))
        return
    print(f"\n{meta}\n")
    print("| loader | workers | rows/s | samples/s | real tokens/s | fill | startup s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['loader']} | {r['workers']} | {r['rows_per_s']:.2f} | {r['samples_per_s']:.1f} | "
              f"{r['real_tokens_per_s']:,.0f} | {r['fill']:.3f} | {r['startup_s']:.1f} |")


if __name__ == "__main__":
    main()
