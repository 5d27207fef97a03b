"""One training run per output folder at a time: a lock on `train.output_dir`.

The lock is an exclusive `flock` on `output_dir/.vlpack-train.lock`, taken by rank 0 before the
run builds anything and held by the process until it exits: the kernel releases it when the
process ends, however it ends (a kill included), so a lock file left by a dead process is
stale and simply taken over. The file names the holder (pid, host, start time, command), which
a refused run prints; a process that exits cleanly empties it, one that was killed leaves its
name there and the next run says it took that lock over. On a filesystem without `flock` (some
network mounts), the holder's pid is checked instead: a holder on this host that no longer runs
is stale; one on another host is trusted until the file is removed.

Locks are kept per process (a second Trainer in the same process, as tests make, holds the
same lock), never per call.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlpack.train.distributed.parallel import Topology

LOCK_NAME = ".vlpack-train.lock"

_HELD: dict[str, int] = {}
"""Lock files this process holds (resolved path → open descriptor), released at exit."""


class OutputDirLockedError(ValueError):
    """Another running `vlpack train` holds the output folder."""


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(h: dict) -> str:
    if not h:
        return "another process (its lock file names no holder)"
    cmd = " ".join(h.get("argv", []))[:200]
    return (f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}"
            + (f" ({cmd})" if cmd else ""))


def _alive(h: dict) -> bool:
    """Whether the holder named in a lock file may still run (unknown hosts count as alive)."""
    if h.get("host") != socket.gethostname() or not isinstance(h.get("pid"), int):
        return bool(h)
    try:
        os.kill(h["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_holder(fd: int) -> None:
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)


def lock_output_dir(out: str | Path) -> Path:
    """Take this process's lock on run folder `out` (created if missing); returns the lock
    file. `OutputDirLockedError` naming the holder when another live process has it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = (out / LOCK_NAME).resolve()
    if str(path) in _HELD:
        return path
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise OutputDirLockedError(
                f"train.output_dir={out} is in use by another vlpack train: "
                f"{_describe(_holder(path))}. Wait for it to finish, stop it, or choose another "
                "train.output_dir") from None
        # no flock on this filesystem: judge the holder the file names
        h = _holder(path)
        if h.get("pid") != os.getpid() and _alive(h):
            os.close(fd)
            raise OutputDirLockedError(
                f"train.output_dir={out} is in use by another vlpack train: {_describe(h)} "
                f"(this filesystem has no flock; if that process is gone, delete {path})"
            ) from None
    stale = _holder(path)
    if stale.get("pid") not in (None, os.getpid()):
        print(f"vlpack: {out} held a stale lock of {_describe(stale)}, which ended without "
              "releasing it; taken over", file=sys.stderr)
    _write_holder(fd)
    _HELD[str(path)] = fd
    atexit.register(release_output_dir, out)  # a clean exit names no holder; a kill leaves it
    return path


def release_output_dir(out: str | Path) -> None:
    """Give up this process's lock on `out` (a no-op when it holds none)."""
    path = (Path(out) / LOCK_NAME).resolve()
    fd = _HELD.pop(str(path), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)


def claim_output_dir(out: str | Path, topo: Topology) -> None:
    """Rank 0 takes the output folder's lock; every rank raises the same
    `OutputDirLockedError` when another run holds it (collective under torchrun)."""
    from vlpack.train.distributed.parallel import broadcast_object

    error = None
    if topo.is_main:
        try:
            lock_output_dir(out)
        except OutputDirLockedError as e:
            error = str(e)
    error = broadcast_object(error, topo)
    if error is not None:
        raise OutputDirLockedError(error)
