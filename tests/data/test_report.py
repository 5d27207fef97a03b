"""`vlpack pack`: every sample accounted for, JSON keys, bad input reported, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from vlpack.cli import main
from vlpack.config import DataConfig
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


def test_pack_without_data_plans_the_synthetic_set_train_reads(capsys) -> None:
    """No flags: the data section's defaults, the built-in set at data.synthetic_samples."""
    d = DataConfig()
    r = run_json(capsys)
    assert (r["samples"], r["seq_len"], r["algo"], r["buffer"]) == (
        d.synthetic_samples, d.seq_len, d.packing, d.buffer_size)


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


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` × `height` and holds no pixel data (enough for a header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


def _with_extra(data: Path, tmp_path: Path, extra: dict[str, bytes]) -> Path:
    """A copy of the dataset plus one sample per extra image (named by its file)."""
    out = tmp_path / "d"
    shutil.copytree(data.parent, out)
    lines = (out / "data.jsonl").read_text().splitlines()
    for name, blob in extra.items():
        (out / name).write_bytes(blob)
        lines.append(json.dumps({"id": name, "image": name, "conversations": [
            {"from": "human", "value": "<image>\nTotal?"}, {"from": "gpt", "value": "1"}]}))
    (out / "data.jsonl").write_text("\n".join(lines) + "\n")
    return out / "data.jsonl"


def test_validate_lists_every_bad_sample_even_a_corrupt_body(capsys, data_with_bad_lines: Path,
                                                             tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (64, 64), (9, 9, 9)).save(tmp_path / "ok.png")
    cut = (tmp_path / "ok.png").read_bytes()[:60]  # header intact, pixels gone
    data = _with_extra(data_with_bad_lines, tmp_path, {"cut.png": cut,
                                                       "bomb.png": _png_header(20000, 20000)})
    # pack judges images by their headers: the cut body passes, the bomb does not.
    r = run_json(capsys, str(data), "--seq-len", "4096", "--overlong", "skip")
    assert "corrupt_image" in r["skipped"] and r["skipped"].get("image_too_large") == 1
    assert main(["data", "validate", str(data), "--workers", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    problems = out[:-1]
    assert out[-1].startswith(f"{r['samples']} samples: {r['samples'] - 6} good, 6 bad")
    assert any(p.startswith("corrupt_image: cut.png: ") for p in problems)  # found only here
    bomb = next(p for p in problems if p.startswith("image_too_large: bomb.png: "))
    assert "decompression-bomb" in bomb and "data.max_image_pixels" in bomb
    assert sum(p.startswith("bad_json: ") and ":11:" in p for p in problems) == 1  # file:line
    # The limit is the user's to raise (and to lower).
    assert main(["data", "validate", str(data_with_bad_lines), "--json", "--workers", "2",
                 "--max-image-pixels", "100"]) == 1
    v = json.loads(capsys.readouterr().out)
    assert v["bad"]["image_too_large"] >= 1 and v["samples"] == 28


def test_clear_errors_for_a_folder_and_an_empty_file(capsys, tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("")
    assert main(["pack", str(tmp_path)]) == 2
    assert "is a folder (it holds a.jsonl)" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "a.jsonl")]) == 2
    assert "holds no records" in capsys.readouterr().err


def test_validate_uses_the_folders_chat_template(capsys, tmp_path: Path) -> None:
    """`vlpack data validate --tokenizer FOLDER` renders with the folder's template as training
    does: a sample that template refuses is listed (template_mismatch), not a crash."""
    from vlpack.data.tokenizer import load_tokenizer

    load_tokenizer("qwen3_vl").save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content is string and 'forbidden' in m.content %}"
        "{{ raise_exception('no forbidden words') }}{% endif %}<|im_start|>{{ m.role }}\n"
        "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
        "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}"
        "{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
            for text in ("fine", "forbidden", "also fine")]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["data", "validate", str(data), "--workers", "1", "--json",
            "--tokenizer", str(tmp_path / "ckpt")]
    assert main(args) == 1
    v = json.loads(capsys.readouterr().out)
    assert v["samples"] == 3 and v["bad"] == {"template_mismatch": 1}, v
    assert main([*args, "--chat-template", "builtin"]) == 0
    capsys.readouterr()


def test_pack_without_flags_packs_as_train_does() -> None:
    """`vlpack pack`'s defaults are data.*'s: with no flags it predicts what `vlpack train` packs."""
    from vlpack.cli import build_parser
    from vlpack.config import DataConfig

    args = build_parser().parse_args(["pack"])
    d = DataConfig()
    assert (args.seq_len, args.algo, args.buffer, args.max_patches, args.overlong,
            args.pad_to_multiple_of) == (d.seq_len, d.packing, d.buffer_size, d.max_patches,
                                         d.overlong, d.pad_to_multiple_of)


# --- what pack and validate name ---------------------------------------------------------------------
# `vlpack pack` and `vlpack data validate` name the samples they refuse (id and file:line) and agree on an
# empty file.
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
