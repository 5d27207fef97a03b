"""Encode and measure throughput of one worker on the synthetic receipts.

    python bench/encode_speed.py [--n 128] [--family qwen3_vl] [--max-pixels N]

Prints samples/s for `Encoder.encode` (image decode + processor + tokens), for the text part
alone, and for `Encoder.measure` (image headers only), plus tokens and patches per sample.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=128, help="synthetic samples")
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--max-pixels", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one worker means one thread

    from vlpack.config import DataConfig
    from vlpack.data.encode import Encoder
    from vlpack.data.sources import read_jsonl
    from vlpack.data.synth import write_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        convs = read_jsonl(write_synthetic(tmp, n=args.n, seed=args.seed))
        t_synth = time.perf_counter() - t0
        t0 = time.perf_counter()
        enc = Encoder.from_config(DataConfig(max_pixels=args.max_pixels), args.family, None)
        t_load = time.perf_counter() - t0
        enc.encode(convs[0])  # warm the image processor

        t0 = time.perf_counter()
        sizes = [enc.measure(c) for c in convs]
        t_measure = time.perf_counter() - t0
        t0 = time.perf_counter()
        samples = [enc.encode(c) for c in convs]
        t_encode = time.perf_counter() - t0
        text_only = [c for c in convs if not c.images]
        t0 = time.perf_counter()
        for c in text_only:
            enc.encode(c)
        t_text = time.perf_counter() - t0

    assert [s.size for s in samples] == sizes
    tokens = np.array([s.tokens for s in sizes])
    patches = np.array([s.patches for s in sizes])
    n = len(convs)
    print(f"family {args.family}, max_pixels {enc.max_pixels}, {n} samples "
          f"({len(text_only)} text-only), synth {t_synth:.2f} s, tokenizer load {t_load:.2f} s")
    print(f"tokens/sample  mean {tokens.mean():.0f}  min {tokens.min()}  max {tokens.max()}")
    print(f"patches/sample mean {patches.mean():.0f}  max {patches.max()}")
    print(f"encode   {n / t_encode:8.1f} samples/s  ({tokens.sum() / t_encode:,.0f} tokens/s)")
    if text_only:
        print(f"  text-only encode {len(text_only) / t_text:8.1f} samples/s")
    print(f"measure  {n / t_measure:8.1f} samples/s")


if __name__ == "__main__":
    main()
