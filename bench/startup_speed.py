"""Start-up to the first bin: read the JSONL, take every sample's size (size cache cold, then
warm), plan and build the first batch, on synthetic data (CPU).

Data: `n` conversations written to a temporary folder. `text`: text only, 20-400 words per
answer. `image`: one or two images per sample, drawn from 64 small PNGs of different sizes
(each sample's header is read; the files are shared to keep generation fast). Each start runs
with a fresh tokenizer hash and an empty (cold) or filled (warm) `$VLPACK_CACHE`; the encoder
is built once beforehand and one tiny start runs first (the tokenizer build and one-time
imports are not part of the figures). Reported per start:
seconds to read, to size, to the first batch, samples/s of sizing, and the index's memory
(bytes per sample of `SizeIndex`'s arrays) and cache file bytes per sample.

    python bench/startup_speed.py --samples 10000 100000 --kinds text image --workers 2
    python bench/startup_speed.py --samples 10000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path


def write_data(folder: Path, n: int, kind: str, seed: int = 0) -> Path:
    """`n` synthetic conversations of `kind` (text | image) in `folder/data.jsonl`."""
    from PIL import Image

    rng = random.Random(seed)
    words = ["receipt", "total", "amount", "tax", "item", "price", "store", "date", "cash"]
    if kind == "image":
        for k in range(64):
            Image.new("RGB", (64 + 24 * (k % 16), 64 + 40 * (k // 16)), (k * 4, 9, 9)).save(
                folder / f"img{k}.png")
    path = folder / "data.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            answer = " ".join(rng.choices(words, k=rng.randint(20, 400)))
            content: object = "Read the receipt and give the total."
            if kind == "image":
                content = [{"type": "image", "image": f"img{rng.randrange(64)}.png"}
                           for _ in range(rng.randint(1, 2))]
                content.append({"type": "text", "text": "Read the receipt."})
            f.write(json.dumps({"id": f"s{i}", "messages": [
                {"role": "user", "content": content},
                {"role": "assistant", "content": answer}]}) + "\n")
    return path


def start(path: Path, encoder, workers: int) -> dict:
    """One start: read, size (cache as it is), first batch. Seconds per phase."""
    from vlpack.config import DataConfig
    from vlpack.data import size_cache
    from vlpack.data.loader import PackedLoader, open_dataset

    size_cache._HASHED.clear()  # a new process hashes the tokenizer again
    t0 = time.perf_counter()
    items = open_dataset("jsonl", str(path))
    t1 = time.perf_counter()
    sizes = size_cache.sample_sizes(items, encoder, path, workers=workers)
    t2 = time.perf_counter()
    d = DataConfig(seq_len=8192, pad_to_multiple_of=1, max_bad_fraction=0.5)
    loader = PackedLoader(items, encoder, d, sizes=sizes, seed=0, pad_token_id=0)
    next(iter(loader))
    t3 = time.perf_counter()
    return {"read_s": t1 - t0, "size_s": t2 - t1, "first_batch_s": t3 - t2, "total_s": t3 - t0,
            "sized_per_s": len(items) / (t2 - t1),
            "index_bytes_per_sample": sizes.nbytes / len(items)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[10_000])
    ap.add_argument("--kinds", nargs="+", choices=["text", "image"], default=["text", "image"])
    ap.add_argument("--workers", type=int, default=2, help="measuring processes")
    ap.add_argument("--family", default="qwen3_vl")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    from vlpack.data.encode import Encoder

    encoder = Encoder(args.family)
    with tempfile.TemporaryDirectory() as tmp:  # one-time imports and caches, not figures
        os.environ["VLPACK_CACHE"] = tmp
        start(write_data(Path(tmp), 16, "image"), encoder, 0)
    rows = []
    for n in args.samples:
        for kind in args.kinds:
            with tempfile.TemporaryDirectory() as tmp:
                os.environ["VLPACK_CACHE"] = str(Path(tmp) / "cache")
                path = write_data(Path(tmp), n, kind)
                for cache in ("cold", "warm"):
                    row = {"samples": n, "kind": kind, "cache": cache, "workers": args.workers,
                           **start(path, encoder, args.workers)}
                    files = list((Path(tmp) / "cache" / "sizes").glob("*.npz"))
                    row["cache_file_bytes_per_sample"] = sum(f.stat().st_size for f in files) / n
                    rows.append(row)
                    if not args.json:
                        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items()), flush=True)
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "python": platform.python_version(),
                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
