"""The profile's GPU idle-gap analysis (vlpack.train.run.profile.idle_gaps) on hand-made traces.

The GPU test `tests/gpu/test_gpu_model.py::test_idle_gap_is_charged_to_the_slow_host_code`
runs it on a real profile."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, small_cfg
from vlpack.train.run.profile import _innermost_at, format_gaps, idle_gaps
from vlpack.train.trainer import Trainer


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_gaps_are_split_into_host_late_and_queued_and_charged_to_the_launching_code():
    trace = [
        _x("kernel", "k1", 0, 100, tid=7, correlation=1),
        _x("kernel", "k2", 150, 50, tid=7, correlation=2),   # 50 µs gap, launched late (120)
        _x("kernel", "k3", 203, 47, tid=7, correlation=3),   # 3 µs: under the threshold
        _x("gpu_memcpy", "m4", 300, 100, tid=8, correlation=4),  # 50 µs gap, launched early (90)
        _x("kernel", "k5", 460, 20, tid=7, correlation=5),   # 60 µs gap, launched late, no Python
        _x("cuda_runtime", "cudaLaunchKernel", 1, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 120, 2, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 130, 2, correlation=3),
        _x("cuda_runtime", "cudaMemcpyAsync", 90, 2, correlation=4),
        _x("cuda_driver", "cuLaunchKernel", 455, 2, tid=2, correlation=5),
        _x("python_function", "vlpack/a.py(1): outer", 0, 500),
        _x("python_function", "torch/nn/modules/module.py(1): _call_impl", 110, 20),
        _x("python_function", "transformers/x.py(5): f", 115, 10),
        _x("python_function", "torch/nn/functional.py(9): linear", 118, 4),
        _x("cpu_op", "aten::linear", 117, 6),
        _x("cpu_op", "aten::mm", 118, 4),
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 440, 30, tid=2),
        _x("cpu_op", "aten::mm", 450, 8, tid=2),
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 120, "tid": 1},  # not a span
    ]
    g = idle_gaps(trace, steps=2)
    assert g["window_us_per_step"] == 240 and g["idle_us_per_step"] == 80
    assert g["host_late_us_per_step"] == 55 and g["queued_us_per_step"] == 25
    assert g["unmatched_us_per_step"] == 0
    assert g["host_late_sites"] == [("aten::mm", 30.0, 1),
                                    ("transformers/x.py(5): f · aten::mm", 25.0, 1)]
    text = format_gaps(g)
    assert "(≥ 5 µs)" in text and "0.1 ms of a 0.2 ms kernel window" in text
    assert "transformers/x.py(5): f" in text


def test_a_launch_still_running_when_the_gpu_ran_dry_is_host_late_and_a_missing_one_unmatched():
    trace = [
        _x("kernel", "k1", 0, 100, tid=7, correlation=1),
        _x("kernel", "k2", 150, 50, tid=7, correlation=2),  # launch 95-140: returned after 100
        _x("kernel", "k3", 200, 10, tid=7),                 # no correlation: sorts beside k2's
        _x("kernel", "k4", 300, 10, tid=7, correlation=4),  # no launch in the trace
        _x("cuda_runtime", "cudaLaunchKernel", 95, 45, correlation=2),
        _x("python_function", "<string>(1): launcher", 94, 50),  # Inductor's: names no caller
        _x("python_function", "nn.Module: Linear_3", 90, 60),
        _x("python_function", "vlpack/b.py(2): g", 0, 300),
    ]
    g = idle_gaps(trace, min_gap_us=20)
    assert g["host_late_us_per_step"] == 50 and g["unmatched_us_per_step"] == 90
    assert g["host_late_sites"] == [("vlpack/b.py(2): g", 50, 1)]
    assert "(≥ 20 µs)" in format_gaps(g)


def test_no_gpu_events_no_gaps():
    g = idle_gaps([_x("cpu_op", "aten::mm", 0, 5)])
    assert g["idle_us_per_step"] is None and "no GPU events" in format_gaps(g)


def _tree(rng: random.Random, t0: float, t1: float, depth: int, out: list) -> None:
    t = t0
    while depth and t < t1 - 2 and rng.random() < 0.8:
        s = t if rng.random() < 0.3 else rng.uniform(t, t1 - 1)  # some children start with it
        e = rng.uniform(s, t1)
        out.append((s, e, f"n{len(out)}"))
        _tree(rng, s, e, depth - 1, out)
        t = e + 0.01


@pytest.mark.parametrize("seed", range(5))
def test_innermost_span_sweep_matches_brute_force(seed):
    rng = random.Random(seed)
    spans: list = []
    _tree(rng, 0.0, 100.0, 5, spans)
    times = [rng.uniform(-1, 101) for _ in range(300)] + [s for s, _, _ in spans]  # ties too
    want = []
    for t in times:
        holding = [s for s in spans if s[0] <= t <= s[1]]
        # the innermost: the latest start, and of spans starting together the shortest
        want.append(min(holding, key=lambda s: (-s[0], s[1]))[2] if holding else None)
    assert _innermost_at(spans, times) == want


def test_innermost_span_of_spans_starting_together_is_the_shorter():
    spans = [(0.0, 10.0, "outer"), (0.0, 5.0, "inner"), (0.0, 0.0, "instant")]
    assert _innermost_at(spans, [0.0, 3.0, 7.0, 11.0]) == ["instant", "inner", "outer", None]


# --- train.profile_steps through the trainer ---------------------------------------------------------
def test_profile_writes_a_summary(tmp_path: Path) -> None:
    """`train.profile_steps`: a table of the profiled step, set against the unprofiled ones."""
    Trainer(small_cfg(tmp_path, "train.max_steps=3", "train.profile_steps=1",
                      "train.profile_from=3"), CPU).fit()
    text = (tmp_path / "profile_rank0.txt").read_text()
    assert text.startswith("1 steps, profiled wall") and "operators only" in text
    assert "operators:" in text and "aten::" in text
    with pytest.raises(ValueError, match=r"lower train\.profile_from"):
        small_cfg(tmp_path, "train.max_steps=3", "train.profile_steps=2", "train.profile_from=3")


def test_profile_stacks_add_host_time_by_call_site(tmp_path: Path) -> None:
    from vlpack.train.run.profile import StepProfiler

    prof = StepProfiler(tmp_path / "p.txt", start=1, count=1, device=torch.device("cpu"), stacks=True)
    prof.before(1)
    x = torch.randn(64, 64)
    for _ in range(3):
        x = torch.tanh(x @ x)
    prof.after(1)
    text = (tmp_path / "p.txt").read_text()
    assert "host time by call site" in text and "test_profile.py" in text
    # the sites themselves, not only Python function events among the operators
    assert "Source Location" in text.split("host time by call site")[1]
