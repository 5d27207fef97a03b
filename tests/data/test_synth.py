"""Synthetic receipts: deterministic per seed, the promised mix, the cached default copy."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from vlpack.data.sources import read_jsonl
from vlpack.data.synth import default_dataset, write_synthetic


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def test_deterministic_per_seed(tmp_path):
    a = write_synthetic(tmp_path / "a", n=12, seed=3)
    b = write_synthetic(tmp_path / "b", n=12, seed=3)
    c = write_synthetic(tmp_path / "c", n=12, seed=4)
    assert a == tmp_path / "a" / "data.jsonl"
    assert _digest(a.parent) == _digest(b.parent)  # jsonl and every image byte-identical
    assert a.read_bytes() != c.read_bytes()
    d = write_synthetic(tmp_path / "d", n=12, seed=3, workers=2)  # rendered in two processes
    assert _digest(d.parent) == _digest(a.parent)


def test_mix_and_sizes(tmp_path):
    path = write_synthetic(tmp_path, n=48, seed=0)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    convs = read_jsonl(path)  # every record parses
    assert len(convs) == 48
    n_images = [len(c.images) for c in convs]
    user_turns = [sum(m.role == "user" for m in c.messages) for c in convs]
    assert n_images.count(0) >= 2 and n_images.count(2) >= 2 and n_images.count(1) >= 20
    assert sum(u > 1 for u in user_turns) >= 2
    assert sum(c.messages[0].role == "system" for c in convs) >= 5
    n_sharegpt = sum("conversations" in r for r in records)
    assert 3 <= n_sharegpt <= 20
    sizes = [Image.open(ref.path).size for c in convs for ref in c.images]
    assert all(300 <= w <= 1000 and 400 <= h <= 1600 for w, h in sizes)
    assert max(w * h for w, h in sizes) > 600_000 > min(w * h for w, h in sizes)
    answer = json.loads(next(m for m in convs[1].messages if m.role == "assistant").content[0])
    assert answer  # the assistant answer is JSON


def test_videos_cycle_frame_rates(tmp_path):
    """Videos come at 1, 2 or 3 fps by sample index (Qwen2.5-VL's second_per_grid = 2 / fps
    then takes several values), each a frame list."""
    from vlpack.data.synth import FPS
    from vlpack.data.types import VideoRef

    convs = read_jsonl(write_synthetic(tmp_path, n=48, seed=0))
    videos = {i: v for i, c in enumerate(convs) for m in c.messages for v in m.content
              if isinstance(v, VideoRef)}
    assert len(videos) >= 2 and all(v.frames and 4 <= len(v.frames) <= 8 for v in videos.values())
    assert {i: v.fps for i, v in videos.items()} == {i: FPS[i % 3] for i in videos}
    assert len({v.fps for v in videos.values()}) >= 2


def test_default_dataset_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VLPACK_CACHE", str(tmp_path))
    path = default_dataset(n=6, seed=1)
    assert path == tmp_path / "synth-n6-s1" / "data.jsonl"
    stamp = path.stat().st_mtime_ns
    assert default_dataset(n=6, seed=1) == path and path.stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def _default(args: tuple[str, int]) -> str:
    import os

    os.environ["VLPACK_CACHE"] = args[0]
    return str(default_dataset(n=args[1], seed=0))


def test_default_dataset_parallel_processes(tmp_path):
    with ProcessPoolExecutor(2) as pool:
        paths = list(pool.map(_default, [(str(tmp_path), 8)] * 4))
    assert len(set(paths)) == 1
    assert len(read_jsonl(paths[0])) == 8
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_cli_synth(tmp_path, capsys):
    from vlpack.cli import main

    assert main(["data", "synth", "--out", str(tmp_path), "--n", "3"]) == 0
    assert len((tmp_path / "data.jsonl").read_text().splitlines()) == 3
    assert "wrote 3 samples" in capsys.readouterr().out


def test_synth_refuses_a_folder_holding_data_unless_told_to_replace_it(tmp_path, capsys):
    """`vlpack data synth` into a folder with a data.jsonl or images/ of its own is refused,
    naming them; with --overwrite they are replaced (no stale image is left) and other files
    stay."""
    from vlpack.cli import main

    (tmp_path / "data.jsonl").write_text('{"id": "precious"}\n')
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds data\.jsonl: .*--overwrite"):
        write_synthetic(tmp_path, n=2)
    assert (tmp_path / "data.jsonl").read_text() == '{"id": "precious"}\n'
    assert main(["data", "synth", "--out", str(tmp_path), "--n", "6", "--overwrite"]) == 0
    many = sorted((tmp_path / "images").iterdir())
    assert main(["data", "synth", "--out", str(tmp_path), "--n", "2", "--overwrite"]) == 0
    few = sorted((tmp_path / "images").iterdir())
    assert len(few) < len(many) and len(read_jsonl(tmp_path / "data.jsonl")) == 2
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match=r"already holds data\.jsonl, images"):
        write_synthetic(tmp_path, n=2)
