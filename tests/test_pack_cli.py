"""`vlpack pack`: every sample accounted for, JSON keys, bad input reported, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vlpack.cli import main
from vlpack.data.synth import default_dataset


@pytest.fixture(scope="module")
def data_with_bad_lines(tmp_path_factory) -> Path:
    src = default_dataset(n=24)
    out = tmp_path_factory.mktemp("bad") / "data"
    shutil.copytree(src.parent, out)
    lines = (out / "data.jsonl").read_text().splitlines()
    first_image = next(json.loads(x) for x in lines if "images/" in x)
    bad = [
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),  # no assistant turn
        json.dumps({"conversations": [{"from": "human", "value": "<image>\nTotal?"},
                                      {"from": "gpt", "value": "1"}], "image": "images/nope.jpg"}),
    ]
    (out / "images" / "corrupt.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    bad.append(json.dumps({"conversations": [{"from": "human", "value": "<image>\nTotal?"},
                                             {"from": "gpt", "value": "1"}],
                           "image": "images/corrupt.jpg"}))
    assert first_image
    (out / "data.jsonl").write_text("\n".join(lines[:10] + bad + lines[10:]) + "\n")
    return out / "data.jsonl"


def run_json(capsys, *args: str) -> dict:
    assert main(["pack", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("algo", ["greedy", "ffd", "bfd"])
def test_pack_json_accounts_for_every_sample(capsys, data_with_bad_lines: Path, algo: str) -> None:
    r = run_json(capsys, str(data_with_bad_lines), "--seq-len", "4096", "--algo", algo,
                 "--buffer", "8", "--overlong", "skip")
    for key in ("samples", "packed", "truncated", "skipped", "bins", "efficiency"):
        assert key in r
    assert r["samples"] == 28
    assert r["packed"] + r["truncated"] + sum(r["skipped"].values()) == 28
    assert r["skipped"]["bad_json"] == 1 and r["skipped"]["no_assistant_turn"] == 1
    assert r["skipped"]["missing_image"] == 1 and r["skipped"]["corrupt_image"] == 1
    assert 0 < r["efficiency"] <= 1


def test_pack_overlong_policies(capsys, data_with_bad_lines: Path) -> None:
    skip = run_json(capsys, str(data_with_bad_lines), "--seq-len", "1024", "--overlong", "skip")
    trunc = run_json(capsys, str(data_with_bad_lines), "--seq-len", "1024", "--overlong", "truncate")
    assert skip["skipped"].get("overlong", 0) > 0
    assert trunc["truncated"] > 0
    assert trunc["packed"] + trunc["truncated"] >= skip["packed"]
    assert main(["pack", str(data_with_bad_lines), "--seq-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert "overlong" in err and "--overlong" in err


def test_pack_table_and_missing_file(capsys, tmp_path: Path) -> None:
    assert main(["pack", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "fill efficiency" in out and "samples in" in out
    assert main(["pack", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_pack_options_match_the_training_config(capsys) -> None:
    base = run_json(capsys, "--seq-len", "4096")
    small = run_json(capsys, "--seq-len", "4096", "--min-pixels", "16384", "--max-pixels", "50176",
                     "--pad-to-multiple-of", "64")
    assert small["real_tokens"] < base["real_tokens"]  # smaller images, fewer vision tokens
    assert small["samples"] == base["samples"]
    assert main(["pack", "--seq-len", "1000", "--pad-to-multiple-of", "64"]) == 2
    assert "multiple" in capsys.readouterr().err
