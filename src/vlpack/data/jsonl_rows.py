"""A JSONL file as a sequence of records, parsed when indexed (`data.source=jsonl`).

Opening a file takes where each record starts from `file_scan.scan` (one pass over the file, or
none while its scan is cached): the byte offset (int64) and the 1-based line number (int32) of
each record, 12 bytes per sample. A record is read (`os.pread`) and parsed
(`sources.parse_line`) when it is indexed, so a process never holds the whole file: the
planner's sizes come from the size cache or from measuring record by record, and a DataLoader
worker reads only the records of the bins it encodes.

Records and their numbering are those of `sources.iter_jsonl` (blank lines are skipped but
counted, the first line may start with a UTF-8 byte-order mark). The file must not change while
it is read; the size cache's fingerprint of its content is taken at the same start.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

from vlpack.data.file_scan import scan
from vlpack.data.media import DataFile
from vlpack.data.sources import MAX_RECORD_BYTES, check_jsonl_path, iter_jsonl, parse_line, too_large
from vlpack.data.types import BadSampleError, Conversation

Item = Conversation | BadSampleError

class JsonlRows(Sequence[Item]):
    """The records of a JSONL file (good ones as `Conversation`, bad ones as their
    `BadSampleError`), read and parsed when indexed; picklable (a worker reopens the file).
    Media paths must resolve inside the file's media root (a bare path: its folder)."""

    def __init__(self, file: DataFile | str | Path) -> None:
        self.file = DataFile.of(file)
        self.path = self.file.path
        check_jsonl_path(self.path)
        found = scan(self.path)
        self.starts, self.lines, self.size = found.starts, found.lines, found.size
        self.rows = range(len(self.starts))
        """The file's records this sequence holds (a slice is a view of the same index)."""
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Item: ...
    @overload
    def __getitem__(self, i: slice) -> JsonlRows: ...

    def __getitem__(self, i):
        if isinstance(i, slice):  # a view: no record is read
            view = copy.copy(self)
            view.rows, view._fd, view._pid = self.rows[i], None, -1
            return view
        i = self.rows[i]  # IndexError past either end
        lo = int(self.starts[i])
        hi = int(self.starts[i + 1]) if i + 1 < len(self.starts) else self.size
        # the line, then any blank lines after it; never more than one record too many bytes
        raw = os.pread(self._file(), min(hi - lo, MAX_RECORD_BYTES + 1), lo)
        if (nl := raw.find(b"\n")) >= 0:
            raw = raw[:nl + 1]
        elif len(raw) > MAX_RECORD_BYTES:  # parse_line refuses it by its length alone
            return too_large(self.path, int(self.lines[i]), self._line_length(lo, hi))
        return parse_line(raw, self.file, int(self.lines[i]))

    def __iter__(self) -> Iterator[Item]:
        """The records in order, read sequentially (a view's by index)."""
        if self.rows == range(len(self.starts)):
            return iter_jsonl(self.file)
        return (self[j] for j in range(len(self)))

    def _line_length(self, lo: int, hi: int) -> int:
        """Bytes of the line that starts at `lo` (its newline included, blank lines after it
        up to `hi` not), read a MiB at a time, never held."""
        at = lo
        while at < hi:
            chunk = os.pread(self._file(), min(hi - at, 2**20), at)
            if (nl := chunk.find(b"\n")) >= 0:
                return at + nl + 1 - lo
            at += len(chunk)
        return hi - lo

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
