"""The multi-process test helper (`tests/helpers.py::run_ranks`): a rank whose work ended and that
then died of gloo's teardown abort counts with its work's exit code; a rank that aborted during
its work does not."""

from __future__ import annotations

import atexit
import os
import sys

from tests.helpers import run_ranks


def _ends(rank: int, port: int, codes: tuple[int, ...], abort_at_exit: bool) -> None:
    if abort_at_exit:
        atexit.register(os.abort)  # as gloo's teardown sometimes does, after the work
    sys.exit(codes[rank])


def _aborts(rank: int, port: int) -> None:
    if rank == 1:
        os.abort()  # during the work


def test_a_teardown_abort_after_the_work_keeps_its_exit_code() -> None:
    assert run_ranks(_ends, (75, 0), False, timeout=120) == [75, 0]
    assert run_ranks(_ends, (75, 0), True, timeout=120) == [75, 0]
    assert run_ranks(_aborts, timeout=120) == [0, -6]
