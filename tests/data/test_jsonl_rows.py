"""`JsonlRows` (data/jsonl_rows.py): records read and parsed when indexed equal the records of
`iter_jsonl`'s sequential read, line numbers and bad lines included, at any block size; opening
a file parses no record; a forked worker and a pickled copy read the same records."""

from __future__ import annotations

import json
import multiprocessing
import pickle
from pathlib import Path

import pytest

from vlpack.data import file_scan, jsonl_rows
from vlpack.data.jsonl_rows import JsonlRows
from vlpack.data.loader import open_dataset
from vlpack.data.sources import iter_jsonl
from vlpack.data.types import BadSampleError, Conversation


def _row(text: str, **extra) -> str:
    return json.dumps({**extra, "messages": [{"role": "user", "content": text},
                                             {"role": "assistant", "content": "ok"}]})


FILES = {
    "plain": "\n".join(_row(f"q{i}") for i in range(5)) + "\n",
    "no final newline": _row("a") + "\n" + _row("b"),
    "blank and whitespace lines": f"\n{_row('a')}\n  \n\t\r\n{_row('b', id='x')}\n\n \n",
    "crlf": _row("a") + "\r\n" + _row("b") + "\r\n",
    "byte-order mark": "\ufeff" + _row("a") + "\n" + _row("b") + "\n",
    "bad lines": f"{{oops\n{_row('a')}\n[1, 2]\n\"s\"\n{_row('b')}   \n",
    "only a mark and a tab": "\ufeff\t\n \r\n  \n ",
}


def _key(item) -> tuple:
    return (type(item).__name__, str(item)) if isinstance(item, BadSampleError) else \
        ("Conversation", item)


@pytest.mark.parametrize("block", [1, 3, 64, 1 << 22])
@pytest.mark.parametrize("name", list(FILES))
def test_indexed_records_equal_the_sequential_read(tmp_path: Path, monkeypatch, name: str,
                                                   block: int) -> None:
    monkeypatch.setattr(file_scan, "BLOCK", block)
    path = tmp_path / "d.jsonl"
    path.write_bytes(FILES[name].encode())
    reference = [_key(x) for x in iter_jsonl(path)]
    rows = JsonlRows(path)
    assert [_key(rows[i]) for i in range(len(rows))] == reference
    assert [_key(rows[i]) for i in range(-len(rows), 0)] == reference
    assert [_key(x) for x in pickle.loads(pickle.dumps(rows))] == reference


def test_a_whitespace_line_over_the_record_cap_is_a_record(tmp_path: Path, monkeypatch) -> None:
    """A line of whitespace longer than a record may be is the record `record_too_large` for
    every reader (the index, the sequential read, energon-prepare's), not a blank line for some:
    the records after it keep their numbers and their media."""
    from vlpack.data import sources

    for module in (sources, file_scan, jsonl_rows):
        monkeypatch.setattr(module, "MAX_RECORD_BYTES", 256)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b" " * 300 + b"\n" + b" " * 100 + b"\n" + _row("a").encode() + b"\n")
    last = tmp_path / "last.jsonl"  # a last line of 257 spaces and no newline: too large too
    last.write_bytes(_row("a").encode() + b"\n" + b" " * 257)
    assert len(JsonlRows(last)) == len(list(iter_jsonl(last))) == 2
    edge = tmp_path / "edge.jsonl"  # 256 spaces and a newline: the largest blank line
    edge.write_bytes(b" " * 256 + b"\n" + _row("a").encode() + b"\n")
    assert len(JsonlRows(edge)) == len(list(iter_jsonl(edge))) == 1
    items = list(iter_jsonl(path))
    assert getattr(items[0], "reason", None) == "record_too_large"
    assert str(items[0]).startswith(f"{path}:1: the record is 301 bytes")
    assert isinstance(items[1], Conversation) and items[1].key == "d.jsonl:3"
    reference = [_key(x) for x in items]
    rows = JsonlRows(path)
    assert [_key(rows[i]) for i in range(len(rows))] == reference
    assert rows.lines.tolist() == [1, 3]


def test_line_numbers_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\n{"a": 1}\n  \n{"b": 2}\n\t\n{"c": 3}')
    found = file_scan.read(path)
    assert found.starts.tolist() == [1, 13, 24] and found.lines.tolist() == [2, 4, 6]
    assert found.size == 32
    rows = JsonlRows(path)  # records without "messages": bad, named by file:line
    assert [str(rows[i]).split(": ")[0] for i in range(3)] == ["d.jsonl:2", "d.jsonl:4",
                                                               "d.jsonl:6"]
    with pytest.raises(IndexError):
        rows[3]


def test_opening_parses_no_record(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(_row(f"q{i}") + "\n" for i in range(50)))
    parsed = []
    real = jsonl_rows.parse_line
    monkeypatch.setattr(jsonl_rows, "parse_line", lambda *a: parsed.append(a) or real(*a))
    rows = open_dataset("jsonl", str(path))
    assert isinstance(rows, JsonlRows) and len(rows) == 50 and not parsed
    assert rows.nbytes == 12 * 50  # the line index: an offset and a line number per record
    assert rows[7].messages[0].content == ("q7",) and len(parsed) == 1
    train, held, odd = rows[:45], rows[45:], rows[::7]  # views: the loaders' splits read nothing
    assert isinstance(train, JsonlRows) and (len(train), len(held), len(odd)) == (45, 5, 8)
    assert len(parsed) == 1
    assert [_key(x) for x in held] == [_key(rows[i]) for i in range(45, 50)]
    assert _key(odd[-1]) == _key(rows[49]) and _key(train[-1]) == _key(rows[44])
    assert [_key(x) for x in pickle.loads(pickle.dumps(held))] == [_key(x) for x in held]
    with pytest.raises(IndexError):
        held[5]


def _read(rows: JsonlRows, i: int) -> str:
    return rows[i].messages[0].content[0]


def test_a_forked_worker_reads_its_own_records(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(_row(f"q{i}") + "\n" for i in range(20)))
    rows = JsonlRows(path)
    assert _read(rows, 0) == "q0"  # the parent's file is open before the fork
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.starmap(_read, [(rows, i) for i in range(20)])
    assert got == [f"q{i}" for i in range(20)] and _read(rows, 19) == "q19"


def test_a_scan_is_reused_while_the_file_is_unchanged(tmp_path: Path, monkeypatch) -> None:
    import hashlib
    import os

    path = tmp_path / "d.jsonl"
    path.write_text("".join(_row(f"q{i}") + "\n" for i in range(30)))
    reads = []
    real = file_scan.read
    monkeypatch.setattr(file_scan, "read", lambda p: reads.append(p) or real(p))
    first = file_scan.scan(path)
    digest = f"{path.stat().st_size}-{hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()}"
    assert first.digest == digest and len(reads) == 1
    again = file_scan.scan(path)
    assert len(reads) == 1  # no byte of the file read
    assert again.digest == digest and again.starts.tolist() == first.starts.tolist()
    assert again.lines.tolist() == first.lines.tolist()
    text = path.read_text().replace("q7", "q8")  # the same byte count, other content
    st = path.stat()
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old modification time
    changed = file_scan.scan(path)
    assert len(reads) == 2 and changed.digest != digest  # the change time told
    monkeypatch.setenv("VLPACK_SIZE_CACHE", "off")
    file_scan.scan(path)
    assert len(reads) == 3
