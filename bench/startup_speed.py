"""Start-up to the first bin: open the JSONL, take every sample's size (size cache cold, then
warm), plan and build the first batch, on synthetic data (CPU), each start in a process of its
own.

Data: `n` conversations written to a temporary folder. `text`: text only, 20-400 words per
answer. `image`: one or two images per sample, drawn from 64 small PNGs of different sizes
(each sample's header is read; the files are shared to keep generation fast). Each start is a
fresh process (`--start`) with an empty (cold) or filled (warm) `$VLPACK_CACHE`; its imports, the
encoder's build and the tokenizer's hash are timed apart (`setup s`) from the start itself.
Reported per start:
seconds to open the data, to size, to the first batch, samples/s of sizing, the index's memory
(bytes per sample of `SizeIndex` and of the JSONL line index), the cache file's bytes per sample,
and the memory the start added to the process (peak resident set over the process's after its
setup: `sizing MiB` up to the sizes, `start MiB` with the first batch; measuring workers apart).

    python bench/startup_speed.py --samples 10000 100000 1000000 --kinds text image --workers 2
    python bench/startup_speed.py --samples 10000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
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


def _rss_kib(field: str) -> int:
    """A memory figure of this process from /proc (VmRSS now, VmHWM its peak), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def start(path: Path, family: str, workers: int) -> dict:
    """One start in this process: read, size (cache as it is), first batch."""
    t_setup = time.perf_counter()
    from vlpack.config import DataConfig
    from vlpack.data import size_cache
    from vlpack.data.encode import Encoder
    from vlpack.data.loader import PackedLoader, open_dataset

    encoder = Encoder.from_config(DataConfig(), family, None)
    size_cache.settings_key(encoder.length_settings())  # the tokenizer's hash: setup, not start
    _ = encoder.image_processor  # transformers' processor modules, imported at the first encode
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    items = open_dataset("jsonl", str(path))
    t1 = time.perf_counter()
    sizes = size_cache.sample_sizes(items, encoder, path, workers=workers)
    t2 = time.perf_counter()
    sized_kib = _rss_kib("VmHWM") - base
    d = DataConfig(seq_len=8192, pad_to_multiple_of=1, max_bad_fraction=0.5)
    loader = PackedLoader(items, encoder, d, sizes=sizes, seed=0, pad_token_id=0)
    next(iter(loader))
    t3 = time.perf_counter()
    n = len(items)
    return {"setup_s": t0 - t_setup, "read_s": t1 - t0, "size_s": t2 - t1,
            "first_batch_s": t3 - t2, "total_s": t3 - t0, "sized_per_s": n / (t2 - t1),
            "index_bytes_per_sample": sizes.nbytes / n,
            "line_index_bytes_per_sample": getattr(items, "nbytes", 0) / n,
            "sizing_mib": sized_kib / 1024, "start_mib": (_rss_kib("VmHWM") - base) / 1024}


def _start_process(path: Path, args: argparse.Namespace, cache: Path) -> dict:
    env = {**os.environ, "VLPACK_CACHE": str(cache)}
    out = subprocess.run([sys.executable, __file__, "--start", str(path), "--workers",
                          str(args.workers), "--family", args.family], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"the start failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[10_000])
    ap.add_argument("--kinds", nargs="+", choices=["text", "image"], default=["text", "image"])
    ap.add_argument("--workers", type=int, default=2, help="measuring processes")
    ap.add_argument("--family", default="qwen3_vl")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--start", type=Path, help=argparse.SUPPRESS)  # one start, in this process
    args = ap.parse_args()
    if args.start is not None:
        print(json.dumps(start(args.start, args.family, args.workers)))
        return
    rows = []
    for n in args.samples:
        for kind in args.kinds:
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                path = write_data(Path(tmp), n, kind)
                written = time.perf_counter() - t
                for cache in ("cold", "warm"):
                    row = {"samples": n, "kind": kind, "cache": cache, "workers": args.workers,
                           "file_mb": path.stat().st_size / 1e6,
                           **_start_process(path, args, Path(tmp) / "cache")}
                    files = list((Path(tmp) / "cache" / "sizes").glob("*.npz"))
                    row["cache_file_bytes_per_sample"] = sum(f.stat().st_size for f in files) / n
                    rows.append(row)
                    if not args.json:
                        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items()), f"(data written in {written:.0f} s)",
                              flush=True)
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_avg": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
