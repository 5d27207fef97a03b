"""Step profiles: torch.profiler over a few training steps, summarised as text.

The profiler slows the host, so the wall time of profiled steps overstates the step. The summary
therefore sets the GPU kernel time per step against `reference_step_s`, the step time measured
without the profiler, when the caller has one (the trainer: the mean of the steps before).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

MATMUL_KERNELS = ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "matmul")
ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")


def _source_name(filename: str) -> str:
    """The file as its import path names it (`transformers/vision_utils.py`,
    `fla/ops/utils/index.py`, `vlpack/model/loss.py`): relative to the longest sys.path entry
    that holds it, wherever the package was installed."""
    roots = [p for p in sys.path if p and filename.startswith(os.path.join(p, ""))]
    return os.path.relpath(filename, max(roots, key=len)) if roots else filename


def count_host_syncs(fn: Callable[[], object], device: torch.device) -> dict | None:
    """Run `fn` once under CUDA's sync debug mode; return how many operations made the host wait
    for the GPU, and where: the innermost frame outside torch (`package/file.py:line function`)
    with its count. Waits inside a backward pass are reported at the line that called
    `backward()` (autograd's threads hand their warnings to the caller). None off CUDA."""
    if device.type != "cuda":
        return None
    sites: Counter[str] = Counter()
    show = warnings.showwarning
    torch_dir = os.path.dirname(torch.__file__) + os.sep  # torch's own frames are not the site

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.startswith((torch_dir, warnings.__file__))]
        f = frames[-1] if frames else None
        if f is not None and f.filename == __file__:
            return  # raised while switching the debug mode, outside `fn`
        sites[f"{_source_name(f.filename)}:{f.lineno} {f.name}" if f else "?"] += 1

    _sync(device)
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return {"count": sum(sites.values()), "sites": dict(sites.most_common())}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepProfiler:
    """Profile steps [start, start + count) (1-based) of a run and write `out` at the end."""

    def __init__(self, out: Path, *, start: int, count: int, device: torch.device,
                 stacks: bool = False):
        self.out, self.start, self.count, self.device = out, start, count, device
        self.stacks = stacks  # also a table of host time by Python call site (slower)
        self._prof = None
        self._t0 = 0.0
        self.summary: dict | None = None

    def covers(self, step: int) -> bool:
        return self.start <= step < self.start + self.count

    def before(self, step: int) -> None:
        """Call before running step `step`."""
        if self.count and step == self.start:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            _sync(self.device)
            # without the verbose config the events keep no stacks and the table no sites
            verbose = torch._C._profiler._ExperimentalConfig(verbose=True) if self.stacks else None
            self._prof = profile(activities=acts, with_stack=self.stacks,
                                 experimental_config=verbose)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def after(self, step: int, reference_step_s: float | None = None) -> None:
        """Call after step `step` ran; the last profiled step writes the summary."""
        if self._prof is not None and step == self.start + self.count - 1:
            _sync(self.device)
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self.summary = summarize(self._prof, wall, self.count, self.out, self.device,
                                     reference_step_s=reference_step_s, stacks=self.stacks)
            self._prof = None


def summarize(prof, wall_s: float, steps: int, out: Path, device: torch.device, *,
              reference_step_s: float | None = None, stacks: bool = False) -> dict:
    """Write the top kernels and operators of a finished profile to `out` (with `stacks`, also
    the host time by Python call site); return the kernel time per step, the GPU-busy share
    and the matmul / attention / other split."""
    kernels: dict[str, float] = {}
    for e in prof.events():
        # user annotations (e.g. "Optimizer.step#AdamW.step") span kernels already counted
        annotation = getattr(e, "is_user_annotation", False) or "#" in e.name
        if e.device_type == torch.autograd.DeviceType.CUDA and not annotation:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e6
    busy = sum(kernels.values())
    share = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, sec in kernels.items():
        low = name.lower()
        # attention first: flash kernels name cutlass types in their template arguments
        kind = ("attention" if any(k in low for k in ATTENTION_KERNELS) else
                "matmul" if any(k in low for k in MATMUL_KERNELS) else "other")
        share[kind] += sec / busy if busy else 0.0
    per_step = busy / steps
    head = f"{steps} steps, profiled wall {wall_s:.3f} s"
    if device.type != "cuda":
        head += " (CPU run: operators only)"
    else:
        head += f", GPU kernel time {busy:.3f} s ({per_step:.3f} s per step)"
    if device.type == "cuda" and reference_step_s:
        head += (f"; against the unprofiled step of {reference_step_s:.3f} s the GPU is busy "
                 f"{100 * per_step / reference_step_s:.0f}% of the step")
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        head + "\n\nkernel share: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in share.items())
        + "\n\ntop kernels (seconds over the profiled steps):\n"
        + "\n".join(f"{sec:9.4f}  {name[:150]}" for name, sec in top)
        + "\n\noperators:\n" + prof.key_averages().table(sort_by=sort, row_limit=40)
        + ("\n\nhost time by call site (operators grouped by their innermost 6 Python "
           "frames):\n" + prof.key_averages(group_by_stack_n=6).table(
               sort_by="self_cpu_time_total", row_limit=40) if stacks else "")
    )
    return {"steps": steps, "profiled_wall_s": wall_s, "kernel_s_per_step": per_step,
            "gpu_busy_of_step": per_step / reference_step_s if reference_step_s else None,
            "kernel_share": share, "file": out.name}
