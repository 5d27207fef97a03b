"""Step profiles: torch.profiler over a few training steps, summarised as text.

The profiler slows the host, so the wall time of profiled steps overstates the step. The summary
therefore sets the GPU kernel time per step against `reference_step_s`, the step time measured
without the profiler, when the caller has one (the trainer: the mean of the steps before).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
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
    gaps = _trace_gaps(prof, steps) if device.type == "cuda" else None
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        head + "\n\nkernel share: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in share.items())
        + "\n\ntop kernels (seconds over the profiled steps):\n"
        + "\n".join(f"{sec:9.4f}  {name[:150]}" for name, sec in top)
        + ("\n\n" + format_gaps(gaps) if gaps else "")
        + "\n\noperators:\n" + prof.key_averages().table(sort_by=sort, row_limit=40)
        + ("\n\nhost time by call site (operators grouped by their innermost 6 Python "
           "frames):\n" + prof.key_averages(group_by_stack_n=6).table(
               sort_by="self_cpu_time_total", row_limit=40) if stacks else "")
    )
    return {"steps": steps, "profiled_wall_s": wall_s, "kernel_s_per_step": per_step,
            "gpu_busy_of_step": per_step / reference_step_s if reference_step_s else None,
            "kernel_share": share, "file": out.name,
            "idle_gaps": {k: v for k, v in gaps.items() if k != "host_late_sites"} if gaps else None}


def _trace_gaps(prof: torch.profiler.profile, steps: int) -> dict | None:
    """`idle_gaps` of a finished profile, through its chrome trace (None, with a warning, where
    the trace cannot be written, read or analysed: the rest of the summary does not need it)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        return idle_gaps(trace.get("traceEvents", []), steps=steps)
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"profile: no idle-gap table, the chrome trace failed: {e!r}", stacklevel=2)
        return None


# --- where the GPU waits: idle gaps in a chrome trace, by the host code that ended them -----------
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# Frames that name no caller: torch itself, Inductor's generated launchers (`<string>`) and
# modules, per-instance module markers, the standard library's plumbing.
_LIBRARY_FRAMES = ("torch/", "<built-in", "<string>", "nn.Module:", "threading.py",
                   "contextlib.py", "functools.py", "enum.py", "typing.py", "logging/")
_GENERATED = "torchinductor"
Span = tuple[float, float, str]  # (start µs, end µs, name)


def _innermost_at(spans: list[Span], times: list[float]) -> list[str | None]:
    """For each of `times`, the innermost of the properly nested `spans` that contains it, or
    None: one sweep over both in time order with a stack of open spans (a span that starts
    with its parent sorts after it, the longer first)."""
    order = sorted(range(len(times)), key=times.__getitem__)
    found: list[str | None] = [None] * len(times)
    stack: list[Span] = []
    spans = sorted(spans, key=lambda sp: (sp[0], -sp[1]))
    i = 0
    for q in order:
        t = times[q]
        while i < len(spans) and spans[i][0] <= t:
            while stack and stack[-1][1] < spans[i][0]:
                stack.pop()
            stack.append(spans[i])
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        found[q] = stack[-1][2] if stack else None
    return found


def _host_spans(trace: list[dict]) -> tuple[dict, dict]:
    """Per thread: the spans of Python frames that name a caller, and of operators."""
    python: dict = {}
    ops: dict = {}
    for e in trace:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        span = (e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "?"))
        if e.get("cat") == "python_function":
            if not span[2].startswith(_LIBRARY_FRAMES) and _GENERATED not in span[2]:
                python.setdefault(e.get("tid"), []).append(span)
        elif e.get("cat") == "cpu_op":
            ops.setdefault(e.get("tid"), []).append(span)
    return python, ops


def idle_gaps(trace: list[dict], *, steps: int = 1, min_gap_us: float = 5.0,
              top: int = 15) -> dict:
    """Where a profiled GPU sat idle, from a chrome trace's events (`traceEvents`).

    The GPU's busy time is the union of its kernels, copies and memsets. Each idle gap of at
    least `min_gap_us` between the first and the last of them is *host-late* when the launch of
    the operation that ended it returned after the GPU ran dry (the host was behind), *queued*
    when it returned earlier (the GPU waited on something else, e.g. another stream), or
    *unmatched* when the trace holds no launch for it. A host-late gap is charged to the code
    that made the launch: the innermost Python frame outside torch on the launching thread
    (autograd's backward threads run none) and the innermost operator there. Times are µs per
    step."""
    gpu = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"))
                  for e in trace if e.get("ph") == "X" and e.get("cat") in GPU_CATS),
                 key=lambda g: (g[0], g[1]))
    if not gpu:
        return {"idle_us_per_step": None}
    launches = {e["args"]["correlation"]: (e["ts"], e["ts"] + e.get("dur", 0), e.get("tid"))
                for e in trace
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    late: list[tuple[float, float, object]] = []  # (gap, launch start, launching thread)
    idle = queued = unmatched = 0.0
    end = gpu[0][1]
    for start, stop, corr in gpu:
        gap = start - end
        if gap >= min_gap_us:
            idle += gap
            launch = launches.get(corr)
            if launch is None:
                unmatched += gap
            elif launch[1] >= end:
                late.append((gap, launch[0], launch[2]))
            else:
                queued += gap
        end = max(end, stop)
    sites, counts = _charge(late, *_host_spans(trace))
    per = 1.0 / steps
    return {
        "min_gap_us": min_gap_us,
        "window_us_per_step": (end - gpu[0][0]) * per,
        "idle_us_per_step": idle * per,
        "host_late_us_per_step": (idle - queued - unmatched) * per,
        "queued_us_per_step": queued * per,
        "unmatched_us_per_step": unmatched * per,
        "host_late_sites": [(name, us * per, counts[name]) for name, us in sites.most_common(top)],
    }


def _charge(late: list[tuple[float, float, object]], python: dict,
            ops: dict) -> tuple[Counter[str], Counter[str]]:
    """Sum host-late gaps (gap, launch time, thread) by the launching frame and operator."""
    sites: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for tid in {tid for _, _, tid in late}:
        mine = [(gap, t) for gap, t, owner in late if owner == tid]
        times = [t for _, t in mine]
        names = zip(_innermost_at(python.get(tid, []), times),
                    _innermost_at(ops.get(tid, []), times), strict=True)
        for (gap, _), (py, op) in zip(mine, names, strict=True):
            where = " · ".join(n for n in (py, op) if n) or "?"
            sites[where] += gap
            counts[where] += 1
    return sites, counts


def format_gaps(g: dict) -> str:
    """`idle_gaps`' result as the profile summary's text section."""
    if g.get("idle_us_per_step") is None:
        return "GPU idle gaps: no GPU events in the trace"
    lines = [
        f"GPU idle gaps (≥ {g['min_gap_us']:g} µs) per step: {g['idle_us_per_step'] / 1e3:.1f} ms "
        f"of a {g['window_us_per_step'] / 1e3:.1f} ms kernel window; host-late "
        f"{g['host_late_us_per_step'] / 1e3:.1f} ms, queued behind other work "
        f"{g['queued_us_per_step'] / 1e3:.1f} ms, launch not in the trace "
        f"{g['unmatched_us_per_step'] / 1e3:.1f} ms",
        "host-late gaps by the code that launched the work ending them (ms per step, gaps):",
    ]
    lines += [f"  {us / 1e3:8.2f}  {n:6d}  {name[:160]}" for name, us, n in g["host_late_sites"]]
    return "\n".join(lines)
