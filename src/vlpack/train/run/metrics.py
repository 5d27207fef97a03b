"""Per-step metrics: one JSON line per step in `output_dir/metrics.jsonl`, plus the end summary.

A training row (`step_row`) holds the step's figures (loss, aux_loss, lr, grad_norm, tokens,
tokens_per_s, packing_efficiency, mfu, step_s, data_wait_s; `recompute_flops_share`: the share
of the FLOPs the step performed that went into recomputing checkpointed layers, which MFU does not
count, train/setup/flops.py), the memory of the step's busiest
moment (`peak_mem_gib` allocated by tensors, `peak_reserved_gib` held by PyTorch's caching
allocator: what other processes cannot use; `alloc_retries`, this process's allocator retries so far,
each a release of its cache that waits for the GPU: `retry_note`), and where the run stands: `time`
(Unix seconds), `elapsed_s` (wall-clock seconds since training started: evaluations, saves and the earlier
processes of a resumed run included; the step's own time is `step_s`), `samples`, `tokens_seen`
(real tokens so far), `eta_s` and, on logged steps, `epoch` (samples consumed / training samples) with the
skipped and truncated counts. An evaluation row holds step, samples, eval_loss and eval_s.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Mirror = Callable[[dict[str, Any]], None]
"""Receives every row written (an experiment tracker, `vlpack.train.run.tracking`)."""


def step_row(step: int, r: Any, *, data_wait: float, totals: dict[str, Any], peak_flops: float | None,
             world_size: int, device: torch.device, eta_s: float | None,
             elapsed_s: float) -> dict[str, Any]:
    """The metrics row of a finished step `r` (a `StepResult`); `totals` already include it."""
    cuda = device.type == "cuda"
    return {
        "step": step, "loss": r.loss, "aux_loss": r.aux_loss, "lr": r.lr,
        "grad_norm": r.grad_norm, "samples": totals["samples"], "label_tokens": r.label_tokens,
        "real_tokens": r.real_tokens, "padded_tokens": r.tokens - r.real_tokens,
        "tokens_per_s": r.real_tokens / (r.seconds + data_wait),
        "packing_efficiency": r.real_tokens / max(r.tokens, 1),
        "mfu": (r.flops / r.seconds / (peak_flops * world_size)) if peak_flops else None,
        "recompute_flops_share": r.flops_recomputed / max(r.flops + r.flops_recomputed, 1.0),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "alloc_retries": alloc_retries(device),
        "step_s": r.seconds, "data_wait_s": data_wait,
        "time": round(time.time(), 3), "elapsed_s": elapsed_s,
        "tokens_seen": totals["real_tokens"], "eta_s": eta_s,
    }


def allocator_counts(device: torch.device) -> dict[str, int]:
    """PyTorch's caching allocator's counts on `device` so far ({} off CUDA), a host read without
    a wait: `num_alloc_retries` (a cudaMalloc failed: the cache released, the allocation retried),
    `num_device_alloc` and `num_device_free` (memory taken from and given back to CUDA)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc",
                                              "num_device_free")}


def alloc_retries(device: torch.device) -> int | None:
    """`allocator_counts`' retries so far (None off CUDA)."""
    return allocator_counts(device).get("num_alloc_retries")


def retry_note(step: int, before: int | None, now: int | None, *, first: bool) -> str | None:
    """What to tell a user whose step `step` made the allocator retry (`before` and `now`: the
    counts at its start and end), None where it did not or it is the process's `first` step
    (which autotunes and compiles). A retry follows a cudaMalloc that failed for lack of memory:
    the allocator synchronizes the device, frees its unused cached blocks and allocates again,
    and the next steps take those blocks from CUDA again: a run at its card's memory cap."""
    if first or before is None or now is None or now <= before:
        return None
    return (f"step {step}: a CUDA allocation failed for lack of memory {now - before} time(s) and "
            "PyTorch's caching allocator freed its cache to retry (each time it waits for the GPU, "
            "and the next steps allocate the cache again): the run trains at the card's memory cap. "
            "Steps run faster with some room: a shorter data.seq_len (`vlpack train ... --dry-run` "
            "prints the plan)")


def epoch_of(accounting: dict[str, Any], n_items: int | None) -> float | None:
    """Epochs consumed: samples consumed (trained or skipped, all ranks) over the training set's
    size (None when the size is unknown, as for a streamed Energon dataset)."""
    return round(accounting["samples"] / n_items, 4) if n_items else None


class MetricsWriter:
    """Appends one JSON object per step and hands it to each of `mirrors`. On resume, lines past
    the resumed step are dropped so the file reads as one uninterrupted run."""

    def __init__(self, path: str | Path, *, resume_step: int = 0, enabled: bool = True,
                 mirrors: tuple[Mirror, ...] = ()):
        self.path = Path(path)
        self.enabled = enabled
        self.mirrors = mirrors
        self.evaluated: dict[int, float | None] = {}
        """The `eval_loss` row of each step that has one, the kept rows of a resumed run's
        included (main rank)."""
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if line.strip()
                    and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(f"{line}\n" for line in kept))
            self.evaluated = {row["step"]: row["eval_loss"] for row in map(json.loads, kept)
                              if "eval_loss" in row}
        elif self.path.exists():
            self.path.unlink()
        self._f = self.path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}
        if "eval_loss" in clean:
            self.evaluated[clean["step"]] = clean["eval_loss"]
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        for mirror in self.mirrors:
            mirror(clean)

    def close(self) -> None:
        if self.enabled:
            self._f.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (ValueError naming the file when missing)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: pass a run folder written by `vlpack train`")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run summary as aligned lines."""
    skipped = ", ".join(f"{k}: {v}" for k, v in s["skipped"].items()) or "none"
    rows = [
        ("steps", s["steps"]),
        ("samples", f"{s['samples']} trained ({s['truncated']} of them truncated); "
                    f"{sum(s['skipped'].values())} skipped ({skipped})"),
        *([("epochs", _epochs(s["epochs"]))] if s.get("epochs") else []),
        *([("sources", ", ".join(f"{k}: {v}" for k, v in s["sources"].items()))]
          if s.get("sources") else []),
        ("tokens", f"{s['real_tokens']:,} real of {s['tokens']:,} processed "
                   f"({100 * s['real_tokens'] / max(s['tokens'], 1):.1f}% real)"),
        ("loss", f"{s['first_loss']:.4f} → {s['last_loss']:.4f}"),
        ("eval loss", "—" if s.get("eval_loss") is None else f"{s['eval_loss']:.4f}"),
        ("time", f"{s['elapsed_s']:.1f}s wall clock, {s['seconds']:.1f}s of it in steps "
                 f"({s['tokens_per_s']:.0f} real tokens/s)"),
        ("checkpoint", s.get("checkpoint") or "—"),
        *([("adapter", s["adapter"])] if s.get("adapter") else []),
        *([("hf export", s["hf_export"])] if s.get("hf_export") else []),
        ("metrics", s["metrics"]),
        ("plot", s.get("plot") or s.get("plot_skipped") or "—"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _epochs(epochs: dict) -> str:
    """Per epoch (1-based): samples consumed, how many trained, how many skipped."""
    def one(e, a) -> str:
        skipped = sum(a["skipped"].values())
        return f"{int(e) + 1}: {a['samples']} ({a['packed'] + a['truncated']} trained, {skipped} skipped)"
    return "; ".join(one(e, a) for e, a in epochs.items())
