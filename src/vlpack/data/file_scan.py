"""A data file read once: where its records start and the digest of its content.

`scan(path)` reads a JSONL file in one pass: each 4 MiB block is hashed (BLAKE2b, the size
cache's key of the content) and searched for newlines (numpy), giving the byte offset and the
1-based line number of each non-blank line. The result is kept in `$VLPACK_CACHE/scans/`, one
file per data file's absolute path, with the file's status (byte count, device and inode,
modification and change times in ns): a later start whose file has the same status takes the
index and digest from there and reads no byte of the data, as `git` trusts its index. Any write
to the file changes its change time, so it is read again (a `touch` too; then only the digest is
recomputed, the sizes stay cached when the content did not change). `VLPACK_SIZE_CACHE=off`
turns this cache off with the size cache.

A line is blank when it holds only ASCII whitespace (as `bytes.strip()` sees it) and is not
longer than a record may be (`sources.MAX_RECORD_BYTES`; a longer line is a record, refused as
too large, as `sources.iter_jsonl` reads it); only a line whose first byte is whitespace is read
again to tell (a record starts with `{`), and never more of it than that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlpack.data.sources import MAX_RECORD_BYTES

SCAN_FORMAT = 2
"""The version of a stored scan's rules (2: a line over MAX_RECORD_BYTES is never blank); a
scan stored under another is read again."""
BLOCK = 1 << 22
"""Bytes read at once."""
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() strips

log = logging.getLogger("vlpack.data")


def cache_root() -> Path | None:
    """vlpack's cache folder (`$VLPACK_CACHE`, default `~/.cache/vlpack`), or None when
    `VLPACK_SIZE_CACHE=off`."""
    if os.environ.get("VLPACK_SIZE_CACHE", "").lower() in ("0", "off", "false", "no"):
        return None
    return Path(os.environ.get("VLPACK_CACHE", Path.home() / ".cache" / "vlpack"))


@dataclass(frozen=True, slots=True)
class FileScan:
    """Offsets (int64) and 1-based line numbers (int32) of a file's non-blank lines, its byte
    count and its content digest (`BYTES-BLAKE2B`)."""

    starts: np.ndarray
    lines: np.ndarray
    size: int
    digest: str


def _status(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def scan(path: str | Path) -> FileScan:
    """The line index and digest of the file at `path`, from the scan cache while the file's
    status is unchanged, else read (and stored)."""
    path = Path(path).absolute()
    root = cache_root()
    status = _status(path)
    if root is None:
        return read(path)
    name = hashlib.blake2b(str(path).encode(), digest_size=16).hexdigest()
    file = root / "scans" / f"{name}.npz"
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta["path"] == str(path) and meta["status"] == status and \
                    meta.get("format") == SCAN_FORMAT:
                return FileScan(z["starts"], z["lines"], status[0], meta["digest"])
    except (OSError, ValueError, KeyError):
        pass  # no scan yet, another file's, or unreadable: read the file
    found = read(path)
    if _status(path) == status:  # not written to while it was read
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}.npz")
        np.savez(tmp, starts=found.starts, lines=found.lines, meta=np.array(json.dumps(
            {"path": str(path), "status": status, "digest": found.digest,
             "format": SCAN_FORMAT})))
        os.replace(tmp, file)
    return found


def read(path: str | Path) -> FileScan:
    """`scan` without the cache: one pass over the file."""
    h = hashlib.blake2b(digest_size=16)
    starts: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]  # line k starts at starts[k]
    firsts: list[np.ndarray] = []  # and its first byte is firsts[k]
    pending = True  # the next block's first byte starts a line
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
            a = np.frombuffer(block, dtype=np.uint8)
            after = np.flatnonzero(a == 10) + 1
            if pending:
                firsts.append(a[:1])
            firsts.append(a[after[after < len(a)]])
            pending = len(after) > 0 and after[-1] == len(a)
            starts.append(after + offset)
            offset += len(a)
        line_start = np.concatenate(starts)
        if line_start[-1] == offset:  # the file ends with a newline: no line after it
            line_start = line_start[:-1]
        first = np.concatenate([np.zeros(0, dtype=np.uint8), *firsts])
        assert len(first) == len(line_start)
        keep = np.ones(len(line_start), dtype=bool)
        for k in np.flatnonzero(_WHITESPACE[first]).tolist():
            hi = int(line_start[k + 1]) if k + 1 < len(line_start) else offset
            f.seek(int(line_start[k]))  # what iter_jsonl's readline(MAX_RECORD_BYTES + 1) reads
            raw = f.read(min(hi - int(line_start[k]), MAX_RECORD_BYTES + 1))
            too_long = len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n")
            keep[k] = too_long or bool(raw.strip())
    kept = np.flatnonzero(keep)
    return FileScan(line_start[kept], (kept + 1).astype(np.int32), offset,
                    f"{offset}-{h.hexdigest()}")
