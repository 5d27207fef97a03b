"""Text that is not Unicode: a lone surrogate (`"\\ud800"`) in a JSON line is a bad sample named
by file:line in `pack`, `data validate` and training, and the other bad samples are still
reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlpack.cli import main
from vlpack.config import DataConfig
from vlpack.data.encode import Encoder
from vlpack.data.loader import PackedLoader, open_dataset
from vlpack.data.sources import parse_record
from vlpack.data.types import BadSampleError


def _turns(user: str, answer: str | None = "ok") -> str:
    msgs = [{"role": "user", "content": user}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": answer})
    return json.dumps({"messages": msgs})


@pytest.fixture
def data(tmp_path: Path) -> Path:
    lines = [_turns("first"), _turns("half a pair: \\ud800 here"), _turns("no answer", None),
             _turns("last")]  # json.dumps escapes the backslash: undo it for line 2's escape
    lines[1] = lines[1].replace("\\\\ud800", "\\ud800")
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert "\ud800" in json.loads(path.read_text().splitlines()[1])["messages"][0]["content"]
    return path


def test_pack_counts_it(data: Path, capsys) -> None:
    assert main(["pack", str(data), "--seq-len", "512", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["skipped"] == {"bad_json": 1, "no_assistant_turn": 1} and r["packed"] == 2


def test_validate_names_it_and_every_other_bad_sample(data: Path, capsys) -> None:
    assert main(["data", "validate", str(data), "--workers", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"bad_json: {data}:2: text holds a lone surrogate (\\ud800")
    assert out[1].startswith("no_assistant_turn: d.jsonl:3: ")
    assert out[-1].startswith("4 samples: 2 good, 2 bad")


def test_training_counts_it_as_a_bad_sample(data: Path) -> None:
    enc = Encoder("qwen3_vl")
    d = DataConfig(seq_len=512, shuffle=False, max_bad_fraction=1.0, pad_to_multiple_of=1)
    loader = PackedLoader(open_dataset("jsonl", str(data)), enc, d, seed=0, epochs=1,
                          pad_token_id=0)
    keys = [k for row in loader for k in row.sample_keys]
    assert sorted(keys) == ["d.jsonl:1", "d.jsonl:4"]
    assert loader.accounting["skipped"] == {"bad_json": 1, "no_assistant_turn": 1}


def test_a_record_from_a_shard_is_refused_too(tmp_path: Path) -> None:
    """The Energon task encoder parses records itself (no JSONL line to check)."""
    record = json.loads(_turns("x \\ud800").replace("\\\\ud800", "\\ud800"))
    with pytest.raises(BadSampleError, match="lone surrogate") as info:
        parse_record(record, base_dir=tmp_path, key="s\udc00k")
    assert info.value.reason == "bad_json"
    str(info.value).encode("utf-8")  # the message itself can be printed
