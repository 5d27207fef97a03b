"""Preemption: SIGTERM (what SLURM and Kubernetes send) or SIGINT on ANY rank stops every rank
at the same step boundary with one consistent checkpoint and exit status 75; the run resumes to
the same losses as an uninterrupted one. A second signal aborts at once, without a traceback."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import SMALL, run_ranks
from vlpack.train.run import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
ARGS = [*SMALL, "train.max_steps=4"]


def _worker(rank: int, port: int, out: str, signal_at: int) -> None:
    """One rank of `vlpack train`; rank 1 sends itself SIGTERM during step `signal_at`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from vlpack.cli import main
    from vlpack.train import trainer

    if signal_at and rank == 1:
        original = trainer.Trainer.train_step

        def step(self, mbs):
            r = original(self, mbs)
            if self.step + 1 == signal_at:  # the step being run
                os.kill(os.getpid(), signal.SIGTERM)
            return r

        trainer.Trainer.train_step = step
    sys.exit(main(["train", *ARGS, f"train.output_dir={out}"]))


def _two_ranks(out: Path, signal_at: int = 0) -> list[int | None]:
    return run_ranks(_worker, str(out), signal_at)


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def test_sigterm_on_one_rank_saves_and_resumes_exactly(tmp_path: Path) -> None:
    assert _two_ranks(tmp_path / "straight") == [0, 0]
    assert _two_ranks(tmp_path / "cut", signal_at=2) == [75, 75]  # both ranks stop, one save
    assert ckpt.latest_checkpoint(tmp_path / "cut").name == "step_00000002"
    assert _two_ranks(tmp_path / "cut") == [0, 0]
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "straight")


def _slow_run(out: str, err: str, *extra: str) -> None:
    """`vlpack train` whose steps after the first take 6 s each, stderr to a file."""
    sys.stderr = open(err, "w", buffering=1)
    os.dup2(sys.stderr.fileno(), 2)
    from vlpack.cli import main
    from vlpack.train import trainer

    original = trainer.Trainer.train_step

    def step(self, mbs):
        if self.step >= 1:
            time.sleep(6)
        return original(self, mbs)

    trainer.Trainer.train_step = step
    sys.exit(main(["train", *SMALL, "train.max_steps=50", f"train.output_dir={out}", *extra]))


def _start_slow(tmp_path: Path, *extra: str):
    """A slow run (see _slow_run) once its first step is done."""
    err = tmp_path / "stderr.txt"
    proc = mp.get_context("spawn").Process(target=_slow_run, args=(str(tmp_path), str(err), *extra))
    proc.start()
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text()):
        time.sleep(0.2)  # the first step is done; the second sleeps 6 s
    return proc, err


def test_grace_period_ends_a_stop_that_takes_too_long(tmp_path: Path) -> None:
    """train.stop_grace_s=1 and a step still 5 s from its end: the run gives up after the grace
    period (exit 130, no traceback, no checkpoint) instead of waiting to be killed."""
    proc, err = _start_slow(tmp_path, "train.stop_grace_s=1")
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(timeout=60)
    text = err.read_text()
    assert proc.exitcode == 130, text[-3000:]
    assert time.monotonic() - t0 < 4.5
    assert "train.stop_grace_s=1 passed" in text and "Traceback" not in text, text[-3000:]
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_second_signal_aborts_without_traceback(tmp_path: Path) -> None:
    """A second SIGTERM 3 s after the first, while the step is still running: the run ends at
    once with exit status 130, no traceback, and no checkpoint written."""
    proc, err = _start_slow(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(3)
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(timeout=60)
    text = err.read_text()
    assert proc.exitcode == 130, text[-3000:]
    assert "stopped without saving" in text and "Traceback" not in text, text[-3000:]
    assert ckpt.latest_checkpoint(tmp_path) is None
