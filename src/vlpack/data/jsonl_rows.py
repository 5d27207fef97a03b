"""A JSONL file as a sequence of records, parsed when indexed (`data.source=jsonl`).

Opening a file scans it once for where each non-blank line starts (numpy over 4 MiB blocks,
about a second per GB; a line that starts with whitespace is read again to tell whether it is
blank) and keeps two arrays: the byte offset (int64) and the 1-based line number (int32) of each
record, 12 bytes per sample. A record is read (`os.pread`) and parsed (`sources.parse_line`)
when it is indexed, so a process never holds the whole file: the planner's sizes come from the
size cache or from measuring record by record, and a DataLoader worker reads only the records of
the bins it encodes.

Records and their numbering are those of `sources.iter_jsonl` (blank lines are skipped but
counted, the first line may start with a UTF-8 byte-order mark). The file must not change while
it is read; the size cache's fingerprint of its content is taken at the same start.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import numpy as np

from vlpack.data.sources import check_jsonl_path, iter_jsonl, parse_line
from vlpack.data.types import BadSampleError, Conversation

Item = Conversation | BadSampleError

BLOCK = 1 << 22
"""Bytes scanned at once when indexing the lines."""
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() strips


def line_index(path: str | Path) -> tuple[np.ndarray, np.ndarray, int]:
    """(byte offset of each non-blank line, its 1-based line number, the file's size).

    A line is blank when it holds only ASCII whitespace (as `bytes.strip()` sees it). Only a
    line whose first byte is whitespace is read again to tell (a record starts with `{`)."""
    starts: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]  # line k starts at starts[k]
    firsts: list[np.ndarray] = []  # and its first byte is firsts[k]
    pending = True  # the next block's first byte starts a line
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
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
            f.seek(int(line_start[k]))
            keep[k] = bool(f.read(hi - int(line_start[k])).strip())
    kept = np.flatnonzero(keep)
    return line_start[kept], (kept + 1).astype(np.int32), offset


class JsonlRows(Sequence[Item]):
    """The records of a JSONL file (good ones as `Conversation`, bad ones as their
    `BadSampleError`), read and parsed when indexed; picklable (a worker reopens the file).
    Media paths must resolve inside `media_root` (None: the file's folder)."""

    def __init__(self, path: str | Path, media_root: str | Path | None = None) -> None:
        self.path = Path(path)
        check_jsonl_path(self.path)
        self.media_root = media_root
        self.base_dir = self.path.parent.absolute()
        self.starts, self.lines, self.size = line_index(self.path)
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> Item: ...
    @overload
    def __getitem__(self, i: slice) -> list[Item]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} of {n}")
        i = int(i) % n
        lo = int(self.starts[i])
        hi = int(self.starts[i + 1]) if i + 1 < n else self.size
        raw = os.pread(self._file(), hi - lo, lo)  # the line, then any blank lines after it
        if (nl := raw.find(b"\n")) >= 0:
            raw = raw[:nl + 1]
        return parse_line(raw, self.path, int(self.lines[i]), self.base_dir, self.media_root)

    def __iter__(self) -> Iterator[Item]:
        """The records in order, read sequentially."""
        return iter_jsonl(self.path, self.media_root)

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked worker opens its own
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None, "_pid": -1}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)

    @property
    def nbytes(self) -> int:
        """Bytes of the line index."""
        return self.starts.nbytes + self.lines.nbytes
