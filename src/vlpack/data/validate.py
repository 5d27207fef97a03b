"""`vlpack data validate DATA`: encode every sample in full (every image decoded and
patchified, as training would) and list every bad one with its reason, before a long run.

`vlpack pack` and training judge images from their headers and meet a corrupt image body only
when its bin is encoded; this command finds those too. Exit status 0 when every sample is good,
1 when any is bad.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from vlpack.config import DataConfig
from vlpack.data.loader import data_file, open_dataset
from vlpack.data.types import BadSampleError, Conversation, located, printable

_ENCODER = None  # the worker process's encoder (set by _init_worker)
_ITEMS = None  # the worker process's dataset (records read when indexed)


def _init_worker(d: DataConfig, family: str, items) -> None:
    """The worker's encoder (`data.tokenizer` serves as the checkpoint folder: its tokenizer,
    chat template and image settings) and dataset."""
    global _ENCODER, _ITEMS
    from vlpack.data.encode import Encoder

    _ENCODER, _ITEMS = Encoder.from_config(d, family, d.tokenizer), items


def _judge(item: Conversation | BadSampleError, seq_len: int | None) -> tuple[str, str] | None:
    """(reason, message) of a bad sample, None for a good one."""
    if isinstance(item, BadSampleError):
        return item.reason, str(item)
    try:
        sample = _ENCODER.encode(item)
    except BadSampleError as e:
        return e.reason, str(located(e, item))
    if seq_len is not None and len(sample) > seq_len:
        return "overlong", (f"{item.name}: {len(sample)} tokens > --seq-len {seq_len} (training "
                            "applies data.overlong to it)")
    return None


def _judge_range(lo: int, hi: int, seq_len: int | None) -> list[tuple[str, str] | None]:
    return [_judge(_ITEMS[i], seq_len) for i in range(lo, hi)]


def validate(d: DataConfig, family: str, *, seq_len: int | None = None, workers: int = 1,
             show_progress: bool = False) -> dict[str, Any]:
    """Encode every record of `d.path` (a JSONL file or a Hugging Face dataset, its media inside
    `d.media_root`, by default its folder) with the encoder `d` and `family` describe; the
    counts and every bad sample, in file order. Each worker reads the records it judges."""
    from vlpack.data.sources import source_kind

    items = open_dataset(source_kind(d.path), data_file(d.path, d))  # refuses an empty file
    ranges = [(i, min(i + 64, len(items))) for i in range(0, len(items), 64)]
    bar = tqdm(total=len(items), desc="validating samples", unit="sample", disable=not show_progress)
    verdicts: list[tuple[str, str] | None] = []
    if workers <= 1:
        _init_worker(d, family, items)
        results = (_judge_range(lo, hi, seq_len) for lo, hi in ranges)
        pool = None
    else:
        # spawn: a forked copy of a process that already runs torch's threads can die at once
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(d, family, items))
        results = pool.map(_judge_range, *zip(*ranges, strict=True), [seq_len] * len(ranges))
    try:
        for out in results:
            verdicts.extend(out)
            bar.update(len(out))
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    bad = [{"reason": r, "message": m} for r, m in filter(None, verdicts)]
    return {"samples": len(items), "good": len(items) - len(bad),
            "bad": dict(sorted(Counter(b["reason"] for b in bad).items())), "problems": bad}  # fmt: skip


def validate_command(d: DataConfig, *, family: str, seq_len: int | None = None,
                     workers: int | None = None, as_json: bool = False) -> int:
    """`vlpack data validate`: encode every sample of `d.path` with the encoder `d` and
    `family` describe, list the bad ones (and those longer than `seq_len`, when given) with
    `workers` processes (None: the CPU count, at most 8); status 1 when any is bad."""
    workers = workers if workers is not None else min(8, os.cpu_count() or 1)
    r = validate(d, family, seq_len=seq_len, workers=workers, show_progress=not as_json)
    if as_json:
        print(json.dumps(r))
    else:
        for p in r["problems"]:
            print(f"{p['reason']}: {printable(p['message'])}")
        reasons = ", ".join(f"{k}: {v}" for k, v in r["bad"].items())
        print(f"{r['samples']} samples: {r['good']} good, {len(r['problems'])} bad"
              + (f" ({reasons})" if reasons else ""))
    return 1 if r["problems"] else 0
