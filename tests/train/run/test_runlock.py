"""Two `vlpack train` into one output folder: the second is refused with the holder named, a
lock left by a killed run is taken over, and only rank 0 takes it."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, small_cfg
from vlpack.train.distributed.parallel import Topology
from vlpack.train.run import runlock
from vlpack.train.trainer import Trainer

HOLD = ("import sys, time; from vlpack.train.run.runlock import lock_output_dir; "
        "lock_output_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding the lock on tmp_path/run; killed (SIGKILL) at the end."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    proc.kill()
    proc.wait()


def test_second_run_is_refused_with_the_holder_named(holder) -> None:
    out, proc = holder
    with pytest.raises(runlock.OutputDirLockedError,
                       match=rf"{out} is in use by another vlpack train: pid {proc.pid} on "):
        Trainer(small_cfg(out), CPU)
    assert not (out / "checkpoints").exists()


def test_lock_of_a_killed_run_is_taken_over(holder, capfd) -> None:
    out, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    path = runlock.lock_output_dir(out)
    try:
        assert f"stale lock of pid {proc.pid} " in capfd.readouterr().err
        assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        runlock.release_output_dir(out)
    assert path.read_text() == ""  # released: no holder named


def test_only_rank_0_takes_the_lock(holder) -> None:
    out, _ = holder
    rank1 = Topology(rank=1, world_size=1, local_rank=0, device=torch.device("cpu"))
    runlock.claim_output_dir(out, rank1)  # rank 1 never looks
    with pytest.raises(runlock.OutputDirLockedError):
        runlock.claim_output_dir(out, CPU)


def test_without_flock_the_holders_pid_decides(holder, monkeypatch) -> None:
    """On a filesystem without flock: a live holder on this host is refused, a dead one's
    lock is taken over."""
    out, proc = holder
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(runlock.OutputDirLockedError, match=rf"pid {proc.pid} .*no flock"):
        runlock.lock_output_dir(out)
    proc.kill()
    proc.wait()
    try:
        runlock.lock_output_dir(out)
    finally:
        runlock.release_output_dir(out)


def test_a_clean_exit_leaves_no_holder(tmp_path: Path, capfd) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(120)", "pass"),
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / runlock.LOCK_NAME).read_text() == ""
    runlock.lock_output_dir(out)
    try:
        assert "stale" not in capfd.readouterr().err
    finally:
        runlock.release_output_dir(out)
