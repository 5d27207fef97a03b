"""The samples `vlpack check --data` packs (check/data.py): the user's file, encoded as
training encodes it, on a model of any vocabulary; one sample of each kind; the media root."""

from __future__ import annotations

import json

import numpy as np

from tests.helpers import _chat, _report, _rows, hf_test_folder
from vlpack.cli import main


def test_check_data_on_a_small_vocabulary(tmp_path, capsys):
    """`--data` on a model of 99 ids: the built-in tokenizer's ids are folded into its
    vocabulary (vision ids mapped to the model's), and packed equals unpacked."""
    from PIL import Image

    folder = hf_test_folder(tmp_path / "m", "qwen2_vl")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(
        tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": "Total?"},
                          {"role": "assistant", "content": "12.50"}]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                       {"type": "text", "text": "What?"}]},
                          {"role": "assistant", "content": "A receipt."}]}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["check", "--model", str(folder), "--data", str(data), "--samples", "2",
                 "--json"]) == 0
    assert _report(capsys)["passed"]


def test_check_data_picks_each_kind_and_skips_bad_records(tmp_path):
    """`--data` takes one sample of each kind the file holds (text, image, frame-list video,
    video file) before more of one kind, keeps file order, and skips bad records it meets,
    naming them; once it has a sample of every kind, it reads no further (a bad record there
    does not stop it)."""
    from tests.helpers import _frames, _mp4
    from vlpack.check.data import load_samples
    from vlpack.data.media import DataFile
    from vlpack.model.build import build_model

    _, spec = build_model("tiny-qwen3_vl", device="meta")
    frames = _frames(tmp_path, 4, size=(64, 64))
    _frames(tmp_path, 1, size=(64, 64), name="im")
    _mp4(tmp_path / "clip.mp4", 9, fps=4)  # skips without PyAV

    def ask(item: dict) -> dict:
        return _chat([item, {"type": "text", "text": "?"}])

    rows = [_chat("a"), _chat("b"), "{bad", ask({"type": "image", "image": "gone.png"}),
            ask({"type": "video", "video": frames, "fps": 2}), _chat("c"),
            ask({"type": "image", "image": "im0.png"}), ask({"type": "video", "video": "clip.mp4"}),
            _chat("d"), "{past"]
    data = _rows(tmp_path, rows)

    def load(n: int):
        samples, _, info = load_samples(spec, samples=n, seed=0, data=DataFile.of(data),
                                        model_name="tiny-qwen3_vl")
        return [s.key.split(":")[1] for s in samples], info

    keys, info = load(4)
    assert keys == ["1", "5", "7", "8"]
    assert info["data_kinds"] == {"text": 1, "image": 1, "video_frames": 1, "video_file": 1}
    assert [x.split(": ")[0].split(":")[-1] for x in info["data_skipped"]] == ["3", "4"]
    assert "gone.png" in info["data_skipped"][1]
    keys, info = load(2)
    assert keys == ["1", "5"] and info["data_kinds_left_out"] == ["image", "video_file"]


def test_check_data_reads_with_the_media_root(tmp_path, capsys):
    """`vlpack check --data` takes `--media-root` as training takes data.media_root: images
    beside the JSONL's folder are refused without it and checked with it."""
    from PIL import Image

    (tmp_path / "media").mkdir()
    (tmp_path / "data").mkdir()
    for i in range(2):
        Image.new("RGB", (64, 48), (40 * i, 9, 9)).save(tmp_path / "media" / f"{i}.png")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"../media/{i}.png"},
                                                       {"type": "text", "text": "Total?"}]},
                          {"role": "assistant", "content": "12.50"}]} for i in range(2)]
    data = tmp_path / "data" / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["check", "--data", str(data), "--samples", "2", "--json"]
    assert main(args) == 2  # no usable sample
    capsys.readouterr()
    assert main([*args, "--media-root", str(tmp_path)]) == 0
    assert _report(capsys)["passed"]
