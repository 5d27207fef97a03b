"""The multi-process test helper (`tests/helpers.py::run_ranks`): a rank whose work ended and that
then died of gloo's teardown abort counts with its work's exit code; a rank that aborted during
its work, or after it without that abort's message, does not."""

from __future__ import annotations

import atexit
import os
import sys
import time

from tests.helpers import TEARDOWN_ABORT, run_ranks


def _abort(message: str) -> None:
    os.write(2, message.encode())
    os.abort()


def _ends(rank: int, port: int, codes: tuple, at_exit: str | None) -> None:
    if at_exit is not None:
        atexit.register(_abort, at_exit)  # as gloo's teardown sometimes does, after the work
    sys.exit(codes[rank])


def _slow_peer(rank: int, port: int) -> None:
    if rank == 0:
        atexit.register(_abort, f"{TEARDOWN_ABORT}\n")
        return
    time.sleep(3)  # still working after rank 0's teardown abort


def _aborts(rank: int, port: int) -> None:
    if rank == 1:
        _abort(TEARDOWN_ABORT)  # during the work: no exit code was written


def test_a_teardown_abort_after_the_work_keeps_its_exit_code() -> None:
    assert run_ranks(_ends, (75, 0), None, timeout=120) == [75, 0]
    assert run_ranks(_ends, (75, 0), f"{TEARDOWN_ABORT}\n", timeout=120) == [75, 0]
    assert run_ranks(_ends, (75, 0), "a late CUDA error\n", timeout=120) == [-6, -6]
    assert run_ranks(_ends, (True, -1), f"{TEARDOWN_ABORT}\n", timeout=120) == [1, 255]
    assert run_ranks(_aborts, timeout=120) == [0, -6]
    # a teardown abort is no failure: the peer still working is not killed after `grace`
    assert run_ranks(_slow_peer, timeout=120, grace=1) == [0, 0]
