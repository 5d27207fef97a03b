"""`vlpack pack`: plan a whole dataset and report how well it packs.

Every input sample is counted exactly once: packed, truncated (and packed), or skipped with a
reason, and every skipped one is listed by name (its id and `file:line`). Nothing is encoded:
sizes come from image headers and video metadata, so this runs fast on large datasets;
`vlpack data validate` decodes every sample and finds the bad bodies this cannot see.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from vlpack.config import DataConfig, TrainConfig
from vlpack.data.loader import data_file, describe, measure_all, open_dataset
from vlpack.data.stream import BinStream
from vlpack.data.types import printable

MAX_LISTED = 20
"""Skipped samples the table lists (the JSON report lists all)."""


def pack_report(
    items, encoder, d: DataConfig, *, seed: int, show_progress: bool = False,
    sizes_of: Callable[[], Sequence] | None = None,
) -> dict:
    """Plan `items` once with the packing settings of `d` (one epoch in file order, flushed)
    and return the report as a dict; the sizes come from `sizes_of()` when given (the size
    cache), else are measured. The report counts every bad sample: the bad-sample limits,
    which stop a training run, do not apply."""
    t0 = time.perf_counter()
    sizes = sizes_of() if sizes_of is not None else measure_all(items, encoder, show_progress=show_progress)
    t1 = time.perf_counter()
    d = replace(d, shuffle=False, max_consecutive_bad=len(items), max_bad_fraction=1.0)
    stream = BinStream(
        sizes=sizes, data=d, seed=seed, epochs=1,
        truncate_fn=lambda i, cap: encoder.truncated_size(items[i], cap),
        describe=lambda i: describe(items[i], i),
    )
    bins = list(stream)
    skips = sorted([s for b in bins for s in b.skips] + list(stream.unattached_skips),
                   key=lambda s: s.index)
    t2 = time.perf_counter()
    acc = stream.account.as_dict()
    assert acc["samples"] == len(items)
    assert acc["packed"] + acc["truncated"] + sum(acc["skipped"].values()) == len(items)
    assert sum(len(b.items) for b in bins) == acc["packed"] + acc["truncated"]
    tokens = np.array([b.tokens for b in bins], dtype=np.int64)
    merge2 = encoder.spec.merge_size**2
    vision = np.array([b.patches // merge2 for b in bins], dtype=np.int64)

    def video_patches(b) -> int:
        cut = dict(b.truncate)
        return sum(encoder.truncated_size(items[i], cut[i]).video_patches if i in cut
                   else sizes[i].video_patches for i in b.items)

    video = np.array([video_patches(b) // merge2 for b in bins], dtype=np.int64)
    per_bin = np.array([len(b.items) for b in bins], dtype=np.int64)
    n = max(len(bins), 1)
    return {
        **acc,
        "bins": len(bins),
        "seq_len": d.seq_len,
        "algo": d.packing,
        "buffer": d.buffer_size,
        "real_tokens": int(tokens.sum()),
        "efficiency": float(tokens.sum() / (n * d.seq_len)) if bins else 0.0,
        "samples_per_bin": float(per_bin.mean()) if bins else 0.0,
        "vision_tokens_per_bin": {
            "mean": float(vision.mean()) if bins else 0.0,
            "min": int(vision.min()) if bins else 0,
            "max": int(vision.max()) if bins else 0,
        },
        "video_tokens_per_bin": {
            "mean": float(video.mean()) if bins else 0.0,
            "min": int(video.min()) if bins else 0,
            "max": int(video.max()) if bins else 0,
        },
        "seconds": {"measure": round(t1 - t0, 3), "plan": round(t2 - t1, 3)},
        "problems": [{"reason": s.reason, "message": s.message} for s in skips],
    }


def format_report(r: dict) -> str:
    """The report as an aligned table."""
    skipped = ", ".join(f"{k}: {v}" for k, v in r["skipped"].items()) or "none"
    v, vv = r["vision_tokens_per_bin"], r["video_tokens_per_bin"]
    rows = [
        ("samples in", r["samples"]),
        ("packed", r["packed"]),
        ("truncated", r["truncated"]),
        ("skipped", f"{sum(r['skipped'].values())} ({skipped})"),
        ("bins", f"{r['bins']} × {r['seq_len']} tokens ({r['algo']}, buffer {r['buffer']})"),
        ("fill efficiency", f"{100 * r['efficiency']:.2f}% (real tokens / bin capacity)"),
        ("samples per bin", f"{r['samples_per_bin']:.2f}"),
        ("vision tokens/bin", f"mean {v['mean']:.0f}, min {v['min']}, max {v['max']}"),
        ("  of them video", f"mean {vv['mean']:.0f}, min {vv['min']}, max {vv['max']}"),
        ("time", f"measure {r['seconds']['measure']:.2f}s, plan {r['seconds']['plan']:.3f}s"),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{w}}  {val}" for k, val in rows]
    problems = r.get("problems", [])
    lines += [f"skipped: {p['reason']}: {printable(p['message'])}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"... and {len(problems) - MAX_LISTED} more (--json lists them all)")
    lines.append("images were judged from their headers only: `vlpack data validate DATA.jsonl` "
                 "decodes every sample and lists every bad one")
    return "\n".join(lines)


def pack_command(d: DataConfig, *, family: str, as_json: bool = False) -> int:
    """`vlpack pack`: plan `d.path` (the built-in set for data.source=synthetic) with the
    packing settings of `d`, encoded as `family`, and print the report (`as_json`: one JSON
    object)."""
    from vlpack.data.encode import Encoder
    from vlpack.data.size_cache import sample_sizes

    items = open_dataset(d.source, data_file(d.path, d), synthetic_samples=d.synthetic_samples)
    encoder = Encoder.from_config(d, family, d.tokenizer)  # data.tokenizer: the checkpoint
    report = pack_report(
        items, encoder, d, seed=TrainConfig().seed, show_progress=not as_json,
        sizes_of=lambda: sample_sizes(items, encoder, items.file, show_progress=not as_json),
    )
    print(json.dumps(report) if as_json else format_report(report))
    return 0
