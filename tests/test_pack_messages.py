"""`vlpack pack` and `vlpack data validate` name the samples they refuse (id and file:line) and
agree on an empty file."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from vlpack.cli import main


def _row(user: str, answer: str = "ok", **extra) -> str:
    return json.dumps({**extra, "messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}]})


def test_pack_lists_skipped_samples_by_name_and_points_to_validate(tmp_path: Path,
                                                                   capsys) -> None:
    Image.new("RGB", (32, 32)).save(tmp_path / "ok.png")
    lines = [_row("hi"), "{oops",
             json.dumps({"id": "r3", "image": "gone.png", "conversations": [
                 {"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "1"}]}),
             _row("long " * 400, id="r4")]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["pack", str(tmp_path / "d.jsonl"), "--seq-len", "256", "--overlong", "skip"]) == 0
    out = capsys.readouterr().out
    assert f"skipped: bad_json: {tmp_path / 'd.jsonl'}:2: not valid UTF-8 JSON" in out
    assert "skipped: missing_image: r3: image " in out and "[d.jsonl:3]" in out
    assert "skipped: overlong: r4 (d.jsonl:4): overlong (" in out
    assert "vlpack data validate DATA.jsonl" in out
    assert main(["pack", str(tmp_path / "d.jsonl"), "--seq-len", "256", "--json",
                 "--overlong", "skip"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["reason"] for p in r["problems"]] == ["bad_json", "missing_image", "overlong"]


def test_overlong_error_names_file_and_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "d.jsonl").write_text("\n".join([_row("a"), _row("long " * 400)]) + "\n")
    assert main(["pack", str(tmp_path / "d.jsonl"), "--seq-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:2 is overlong" in err and "sample #" not in err


def test_validate_refuses_an_empty_file_as_pack_does(tmp_path: Path, capsys) -> None:
    (tmp_path / "e.jsonl").write_text("\n\n")
    for cmd in (["pack"], ["data", "validate", "--workers", "1"]):
        assert main([*cmd, str(tmp_path / "e.jsonl")]) == 2, cmd
        assert "holds no records" in capsys.readouterr().err
