"""Videos: sources, sampling, sizes, patches, tokens and positions against transformers and
against literal, hand-worked cases.

Tests that run transformers' video processors need torchvision (the GPU machine has it; the
CPU CI does not) and skip without it; the rest need nothing beyond the dev install (PyAV for
the container files).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import _frames, _mp4
from vlpack.data import video as vid
from vlpack.data.encode import Encoder
from vlpack.data.media import DataFile
from vlpack.data.rope import mrope_positions
from vlpack.data.sources import parse_record
from vlpack.data.types import TOKEN_TYPE_VIDEO, BadSampleError, VideoRef
from vlpack.families import family

ROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")


def _record(tmp_path: Path, content: list, answer: str = "a clip") -> dict:
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": answer}]}


# ---------------------------------------------------------------- sources


def test_sources_read_video_items_and_placeholders(tmp_path: Path) -> None:
    conv = parse_record(_record(tmp_path, [
        {"type": "video", "video": ["a.png", "b.png"], "fps": 4},
        {"type": "text", "text": "and"},
        {"type": "video", "video": "clip.mp4"},
        {"type": "image", "image": "im.png"}]), file=DataFile(tmp_path), key="k")
    v1, v2, im = conv.visuals
    assert v1 == VideoRef(frames=(tmp_path / "a.png", tmp_path / "b.png"), fps=4.0)
    assert v2 == VideoRef(path=tmp_path / "clip.mp4")
    assert im.path == tmp_path / "im.png"
    share = parse_record({"conversations": [
        {"from": "human", "value": "<video> then <image> then <video>"},
        {"from": "gpt", "value": "ok"}], "videos": ["x.mp4", ["f0.png", "f1.png"]],
        "images": ["i.png"]}, file=DataFile(tmp_path), key="s")
    kinds = [type(c).__name__ for c in share.messages[0].content]
    assert kinds == ["VideoRef", "str", "ImageRef", "str", "VideoRef"]
    assert share.visuals[2].frames == (tmp_path / "f0.png", tmp_path / "f1.png")


@pytest.mark.parametrize("record, reason", [
    ({"conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}]},
     "video_count_mismatch"),
    (_record(Path("."), [{"type": "video", "video": []}]), "bad_schema"),
    (_record(Path("."), [{"type": "video", "video": "a.mp4", "fps": 0}]), "bad_schema"),
    (_record(Path("."), [{"type": "video", "video": "a.mp4", "fps": float("inf")}]), "bad_schema"),
    (_record(Path("."), [{"type": "video", "video": ["a.png"], "fps": 1e-308}]), "bad_schema"),
    (_record(Path("."), [{"type": "video", "video": "a.mp4", "fps": float("nan")}]), "bad_schema"),
    (_record(Path("."), [{"type": "video", "video": "http://x/a.mp4"}]), "bad_schema"),
])
def test_bad_video_records_are_named(record: dict, reason: str) -> None:
    with pytest.raises(BadSampleError) as e:
        parse_record(record, file=DataFile(Path(".")), key="rec7")
    assert e.value.reason == reason and "rec7" in str(e.value)


# ---------------------------------------------------------------- sampling and sizes


def test_frame_sampling_hand_worked() -> None:
    # 30 frames at 10 fps sampled at 2 fps: 6 frames.
    meta = vid.VideoMeta(total_frames=30, fps=10.0, width=64, height=64)
    s = vid.VideoSettings()
    # qwen2: an even count at stride 30/6 = 5 from frame 0.
    assert vid.sample_indices("qwen2_vl", meta, s) == (0, 5, 10, 15, 20, 25)
    # qwen3: 6 frames from first to last, rounded: linspace(0, 29, 6).
    assert vid.sample_indices("qwen3_vl", meta, s) == (0, 6, 12, 17, 23, 29)
    # a 1-second clip still gets min_frames = 4; qwen2 floors 5 to 4
    short = vid.VideoMeta(total_frames=5, fps=5.0, width=64, height=64)
    assert vid.sample_indices("qwen2_vl", short, s) == (0, 1, 2, 3)
    assert vid.sample_indices("qwen3_vl", short, s) == (0, 1, 3, 4)  # linspace(0, 4, 4)
    # max_frames caps it
    long = vid.VideoMeta(total_frames=1000, fps=10.0, width=64, height=64)
    capped = vid.VideoSettings(max_frames=8)
    assert len(vid.sample_indices("qwen2_vl", long, capped)) == 8
    assert len(vid.sample_indices("qwen3_vl", long, capped)) == 8


def test_frame_size_hand_worked() -> None:
    s = vid.VideoSettings(cap_pixels_per_frame=False)
    # qwen2: per-frame area within [128, 768] merged tokens of 28²: 280x420 rounds to itself
    assert vid.frame_size("qwen2_vl", 4, 280, 420, s) == (280, 420)
    # qwen3: the clip's area: 4 frames × 90×120 = 43,200 < 128·32² → scaled up to
    # ceil(90·β/32)·32 × ceil(120·β/32)·32 with β = sqrt(131072 / 43200) = 1.7418
    assert vid.frame_size("qwen3_vl", 4, 90, 120, s) == (160, 224)
    # the cap shares qwen3's 768·32² per-clip budget with a 1.05·min floor per frame
    capped = vid.frame_size("qwen3_vl", 100, 1080, 1920, vid.VideoSettings())
    assert capped[0] * capped[1] <= max(768 * 32 * 32 // 100, int(128 * 32 * 32 * 1.05))


def test_qwen3_refuses_a_one_frame_video(tmp_path: Path) -> None:
    names = _frames(tmp_path, 1)
    with pytest.raises(BadSampleError) as e:
        vid.plan("qwen3_vl", "k", VideoRef(frames=(tmp_path / names[0],)), vid.VideoSettings())
    assert e.value.reason == "bad_video" and "f0.png" in str(e.value)
    # qwen2 pads it to two frames, as its processor does
    p = vid.plan("qwen2_vl", "k", VideoRef(frames=(tmp_path / names[0],)), vid.VideoSettings())
    assert p.grid[0] == 1


# ---------------------------------------------------------------- patches


def _slow_patches(frames_FHW3: np.ndarray, plan: vid.VideoPlan, patch: int, merge: int,
                  mean: float, std: float) -> np.ndarray:
    """The patch layout written out with loops: for each temporal patch, each merge block
    (row-major), each patch inside it (row-major): channels × 2 frames × patch × patch."""
    x = torch.from_numpy(frames_FHW3).permute(0, 3, 1, 2)
    x = torch.nn.functional.interpolate(x.contiguous(), size=(plan.height, plan.width),
                                        mode="bicubic", align_corners=False, antialias=True)
    x = ((x.float() / 255.0 - mean) / std).numpy()
    if len(x) % 2:
        x = np.concatenate([x, x[-1:]])
    t, h, w = plan.grid
    rows = []
    for ti in range(t):
        for bh in range(h // merge):
            for bw in range(w // merge):
                for mh in range(merge):
                    for mw in range(merge):
                        r, c = (bh * merge + mh) * patch, (bw * merge + mw) * patch
                        block = x[2 * ti : 2 * ti + 2, :, r : r + patch, c : c + patch]
                        rows.append(block.transpose(1, 0, 2, 3).reshape(-1))
    return np.stack(rows)


@pytest.mark.parametrize("fam, n", [("qwen2_vl", 5), ("qwen3_vl", 4)])
def test_patch_layout_against_loops(tmp_path: Path, fam: str, n: int) -> None:
    names = _frames(tmp_path, n)
    ref = VideoRef(frames=tuple(tmp_path / m for m in names))
    plan = vid.plan(fam, "k", ref, vid.VideoSettings())
    frames = vid.decode("k", ref, plan.indices)
    ours = vid.patches(frames, plan, fam, (0.5,) * 3, (0.25,) * 3)
    f = family(fam)
    np.testing.assert_allclose(ours, _slow_patches(frames, plan, f.patch_size, f.merge_size,
                                                   0.5, 0.25), atol=1e-6)
    assert ours.shape == (int(np.prod(plan.grid)), 3 * 2 * f.patch_size**2)


# ---------------------------------------------------------------- encode and measure


def _conv(tmp_path: Path, content: list, key: str = "k"):
    return parse_record(_record(tmp_path, content), file=DataFile(tmp_path), key=key)


@pytest.mark.parametrize("fam", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_measure_equals_encode_for_frames_and_files(tmp_path: Path, fam: str) -> None:
    names = _frames(tmp_path, 7)
    _frames(tmp_path, 1, size=(64, 64), name="im")
    content = [{"type": "text", "text": "look"},
               {"type": "video", "video": names, "fps": 3},
               {"type": "image", "image": "im0.png"}]
    if importlib.util.find_spec("av"):
        _mp4(tmp_path / "clip.mp4", 23, fps=10)
        content.append({"type": "video", "video": "clip.mp4"})
    enc = Encoder(fam)
    conv = _conv(tmp_path, content)
    sample = enc.encode(conv)
    assert enc.measure(conv) == sample.size
    assert sample.pixel_values.shape[0] == sample.size.patches
    spans = (sample.mm_token_type_ids == TOKEN_TYPE_VIDEO).sum()
    m2 = family(fam).merge_size ** 2
    videos = sample.visual_kinds == TOKEN_TYPE_VIDEO
    assert spans == (sample.image_grid_thw[videos].prod(axis=1) // m2).sum()
    # the mp4 (23 frames at 10 fps, 2 fps wanted): 4 frames by each family's rule
    if importlib.util.find_spec("av"):
        assert sample.image_grid_thw[-1][0] == 2


def test_qwen3_timestamps_and_qwen2_5_second_per_grid(tmp_path: Path) -> None:
    names = _frames(tmp_path, 5)
    content = [{"type": "video", "video": names, "fps": 2}]
    enc = Encoder("qwen3_vl")
    s = enc.encode(_conv(tmp_path, content))
    text = enc.tokenizer.decode(s.input_ids)
    # frames 0..4 at 2 fps, last repeated: pairs (0, .5), (1, 1.5), (2, 2) → 0.25, 1.25, 2.0
    assert "<0.2 seconds><|vision_start|>" in text and "<1.2 seconds><|vision_start|>" in text
    assert "<2.0 seconds><|vision_start|>" in text and text.count("<|vision_start|>") == 4
    assert "user\n<|vision_start|><0.2 seconds><|vision_start|>" in text  # the outer pair stays
    assert text.count("<|vision_end|><|vision_end|>") == 1
    s25 = Encoder("qwen2_5_vl").encode(_conv(tmp_path, content))
    assert s25.second_per_grid.tolist() == [1.0]  # 2 frames / 2 fps
    assert s25.temporal_step.tolist() == [2.0]    # × tokens_per_second 2


def test_truncation_never_splits_a_video(tmp_path: Path) -> None:
    names = _frames(tmp_path, 4)
    enc = Encoder("qwen3_vl")
    conv = parse_record({"messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": [{"type": "video", "video": names}]},
        {"role": "assistant", "content": "a clip"}]}, file=DataFile(tmp_path), key="k")
    s = enc.encode(conv)
    video = np.flatnonzero(s.mm_token_type_ids == TOKEN_TYPE_VIDEO)
    gap = np.flatnonzero(np.diff(video) > 1)[0] + 1  # past its first temporal patch
    at = int(video[gap]) + 1  # inside the second temporal patch's span
    cut = enc.truncate(s, at)
    assert len(cut.image_grid_thw) == 0 and cut.pixel_values.shape[0] == 0
    assert not (cut.mm_token_type_ids == TOKEN_TYPE_VIDEO).any()
    assert len(cut) <= video[0] - 8  # before the outer <|vision_start|> and the first time
    assert enc.tokenizer.decode(cut.input_ids).endswith("<|im_start|>user\n")
    assert enc.truncated_size(conv, at) == cut.size
    whole = enc.truncate(s, int(video[-1]) + 3)  # both closing <|vision_end|> fit: kept
    assert whole.image_grid_thw.tolist() == s.image_grid_thw.tolist()
    assert len(enc.truncate(s, int(video[-1]) + 2).image_grid_thw) == 0  # the outer one does not


def test_bad_videos_are_counted_skips_naming_the_file(tmp_path: Path) -> None:
    names = _frames(tmp_path, 3)
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    _frames(tmp_path / "odd", 1, size=(40, 40))
    enc = Encoder("qwen2_vl")
    cases = {
        "missing_video": [{"type": "video", "video": [*names, "gone.png"]}],
        "corrupt_video": [{"type": "video", "video": "broken.mp4"}],
        "bad_video": [{"type": "video", "video": [*names, "odd/f0.png"]}],
    }
    if not importlib.util.find_spec("av"):
        cases.pop("corrupt_video")
    for reason, content in cases.items():
        with pytest.raises(BadSampleError) as e:
            enc.encode(_conv(tmp_path, content, key=f"s-{reason}"))
        assert e.value.reason == reason, (reason, e.value)
        assert f"s-{reason}" in str(e.value)
        assert "gone.png" in str(e.value) or "broken.mp4" in str(e.value) or "f0.png" in str(e.value)


# ---------------------------------------------------------------- untrusted files


def _unread(*paths: Path) -> None:
    """Set the access time of `paths` to 0, so that a later read shows (relatime updates an
    access time older than the modification time)."""
    for path in paths:
        os.utime(path, (0, time.time()))


def test_only_single_file_containers_are_opened(tmp_path: Path) -> None:
    """An HLS playlist, an ffconcat list named .mp4 and an image2 pattern would make FFmpeg read
    files outside the media root: each is refused as unsupported_video, in training and in
    energon-prepare, before anything outside is read; real mp4, mpeg-ts and mkv files open."""
    pytest.importorskip("av")
    from vlpack.data.energon.prepare import prepare_energon

    out, root = tmp_path / "outside", tmp_path / "root"
    out.mkdir(), root.mkdir()
    _mp4(out / "secret.ts", 4)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(out / "private.png")
    (root / "clip.m3u8").write_text("#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:2.0,\n"
                                    f"{out / 'secret.ts'}\n#EXT-X-ENDLIST\n")
    (root / "link").symlink_to(out)
    (root / "concat.mp4").write_text("ffconcat version 1.0\nfile link/secret.ts\n")
    Image.new("RGB", (64, 64)).save(root / "seq%d.png")
    for i in range(2):
        (root / f"seq{i}.png").symlink_to(out / "private.png")
    _unread(out / "private.png")
    (out / "private.png").read_bytes()
    if os.stat(out / "private.png").st_atime == 0:
        pytest.skip("this file system keeps no access times")
    _unread(out / "secret.ts", out / "private.png")
    enc = Encoder("qwen2_vl")
    for name in ("clip.m3u8", "concat.mp4", "seq%d.png"):
        conv = _conv(root, [{"type": "video", "video": name}], key=name)
        for call in (enc.measure, enc.encode):
            with pytest.raises(BadSampleError, match="not in a container vlpack reads") as e:
                call(conv)
            assert e.value.reason == vid.UNSUPPORTED and str(e.value).startswith(name)
    for name, n in (("ok.mp4", 7), ("ok.ts", 6), ("ok.mkv", 5)):
        _mp4(root / name, n)
        conv = _conv(root, [{"type": "video", "video": name}])
        assert enc.measure(conv) == enc.encode(conv).size
    lines = [json.dumps({"id": n, **_record(root, [{"type": "video", "video": n}])})
             for n in ("clip.m3u8", "concat.mp4", "seq%d.png", "ok.mp4")]
    (root / "d.jsonl").write_text("\n".join(lines) + "\n")
    report = prepare_energon(root / "d.jsonl", tmp_path / "ds")
    assert report["samples"] == 1 and report["skipped"] == {"corrupt_video": 3}, report
    assert os.stat(out / "secret.ts").st_atime == os.stat(out / "private.png").st_atime == 0


def test_frames_above_the_image_pixel_limit_are_refused_when_measured(tmp_path: Path) -> None:
    """A video whose frames exceed data.max_image_pixels is refused from its header, as
    video_too_large, without decoding; at the limit it is measured."""
    names = _frames(tmp_path, 4, size=(90, 120))
    content = [(names, 90 * 120)]
    if importlib.util.find_spec("av"):
        _mp4(tmp_path / "clip.mp4", 8, size=(64, 96))
        content.append(("clip.mp4", 64 * 96))
    for video, pixels in content:
        conv = _conv(tmp_path, [{"type": "video", "video": video}], key="big")
        with pytest.raises(BadSampleError, match=r"data\.max_image_pixels") as e:
            Encoder("qwen2_vl", max_image_pixels=pixels - 1).measure(conv)
        assert e.value.reason == vid.TOO_LARGE and str(e.value).startswith("big: video")
        assert f"{pixels:,} pixels" in str(e.value) or "exceeds limit of" in str(e.value)
        Encoder("qwen2_vl", max_image_pixels=pixels).measure(conv)
    big = vid.VideoMeta(total_frames=4, fps=2.0, width=20000, height=10000)  # 200 M pixels
    with pytest.MonkeyPatch.context() as m:
        m.setattr(vid, "read_meta", lambda key, ref: big)
        with pytest.raises(BadSampleError) as e:  # the default: Pillow's limit, as for images
            vid.plan("qwen2_vl", "k", VideoRef(path=tmp_path / "x.mp4"), vid.VideoSettings())
    assert e.value.reason == vid.TOO_LARGE and "178,956,970" in str(e.value)


def test_a_frame_list_longer_than_max_frames_is_refused(tmp_path: Path) -> None:
    names = _frames(tmp_path, 5)
    ref = VideoRef(frames=tuple(tmp_path / n for n in names))
    with pytest.raises(BadSampleError, match="5 frames, more than max_frames=4") as e:
        vid.plan("qwen2_vl", "k", ref, vid.VideoSettings(max_frames=4))
    assert e.value.reason == vid.TOO_LARGE
    assert vid.plan("qwen2_vl", "k", ref, vid.VideoSettings(max_frames=5)).indices == (0, 1, 2, 3, 4)


def test_frames_are_resized_as_they_are_decoded(tmp_path: Path, monkeypatch) -> None:
    """Decoding holds one full-size frame at a time (each is resized right after it is
    decoded), with the bits of resizing them all at once; encode decodes so."""
    import tracemalloc

    names = _frames(tmp_path, 6, size=(300, 400))
    refs = [VideoRef(frames=tuple(tmp_path / n for n in names))]
    if importlib.util.find_spec("av"):
        _mp4(tmp_path / "clip.mp4", 9, size=(240, 320))
        refs.append(VideoRef(path=tmp_path / "clip.mp4"))
    for ref in refs:
        p = vid.plan("qwen3_vl", "k", ref, vid.VideoSettings())
        full = vid.decode("k", ref, p.indices)
        small = vid.decode("k", ref, p.indices, (p.height, p.width))
        assert small.shape == (len(p.indices), p.height, p.width, 3) != full.shape
        np.testing.assert_array_equal(vid.patches(small, p, "qwen3_vl", (0.5,) * 3, (0.5,) * 3),
                                      vid.patches(full, p, "qwen3_vl", (0.5,) * 3, (0.5,) * 3))
    p = vid.plan("qwen2_vl", "k", refs[0], vid.VideoSettings(min_pixels=56 * 56,
                                                             max_pixels=112 * 112))
    tracemalloc.start()
    small = vid.decode("k", refs[0], p.indices, (p.height, p.width))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert small.nbytes < 300 * 400 * 3  # all six resized frames: less than one full frame
    # one full frame in flight (Pillow's bytes of it and numpy's copy): 3 frames' bytes, not
    # the 12 of keeping all six full frames and stacking them
    assert peak < small.nbytes + 4 * 300 * 400 * 3, peak
    sizes = []
    decode = vid.decode
    monkeypatch.setattr(vid, "decode", lambda *a: sizes.append(a[3:]) or decode(*a))
    Encoder("qwen3_vl").encode(_conv(tmp_path, [{"type": "video", "video": names}]))
    p = vid.plan("qwen3_vl", "k", refs[0], vid.VideoSettings())
    assert sizes == [((p.height, p.width),)]


# ---------------------------------------------------------------- positions


def _hf_rope(fam: str, s) -> np.ndarray:
    """transformers' get_rope_index of one encoded sample, on a stand-in `self`."""
    names = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel",
             "qwen3_vl": "Qwen3VLModel", "qwen3_5": "Qwen3_5Model"}
    cls = getattr(importlib.import_module(f"transformers.models.{fam}.modeling_{fam}"), names[fam])
    ids = family(fam).ids
    vision = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=2, temporal_patch_size=2)
    config = types.SimpleNamespace(vision_config=vision, **{k: v for k, v in ids.items()
                                                           if k.endswith("token_id")})
    fake = types.SimpleNamespace(config=config, spatial_merge_size=2)
    if hasattr(cls, "get_vision_position_ids"):
        fake.get_vision_position_ids = types.MethodType(cls.get_vision_position_ids, fake)
    hf = s.hf_visuals()
    kwargs = {"input_ids": torch.as_tensor(s.input_ids)[None]}
    for name in ("image_grid_thw", "video_grid_thw"):
        kwargs[name] = None if hf[name] is None else torch.as_tensor(hf[name])
    params = inspect.signature(cls.get_rope_index).parameters
    if "second_per_grid_ts" in params and hf["second_per_grid_ts"] is not None:
        kwargs["second_per_grid_ts"] = torch.as_tensor(hf["second_per_grid_ts"])
    if "mm_token_type_ids" in params:
        kwargs["mm_token_type_ids"] = torch.as_tensor(s.mm_token_type_ids, dtype=torch.int32)[None]
    pos, _ = cls.get_rope_index(fake, **kwargs)
    return pos[:, 0].numpy()


@pytest.mark.parametrize("fam", ROPE_FAMILIES)
def test_video_positions_match_transformers(tmp_path: Path, fam: str) -> None:
    a, b = _frames(tmp_path, 6, size=(60, 200)), _frames(tmp_path, 3, name="g", seed=1)
    _frames(tmp_path, 1, size=(64, 64), name="im")
    conv = _conv(tmp_path, [{"type": "text", "text": "first"},
                            {"type": "video", "video": a, "fps": 2},
                            {"type": "image", "image": "im0.png"},
                            {"type": "video", "video": b, "fps": 1}])
    s = Encoder(fam).encode(conv)
    ours = mrope_positions(s.mm_token_type_ids, s.image_grid_thw, 2, s.temporal_step,
                           after_video="transformers")
    np.testing.assert_array_equal(ours, _hf_rope(fam, s))


def test_qwen2_5_fractional_time_step_hand_worked() -> None:
    # one video of 3 temporal patches of 2x2 merged tokens, 0.75 s per patch: step 2 × 0.75
    # = 1.5 → temporal positions floor(0, 1.5, 3.0) = 0, 1, 3 after 2 text tokens
    types_ = np.array([0, 0] + [2] * 12 + [0], dtype=np.int8)
    pos = mrope_positions(types_, np.array([[3, 4, 4]]), 2, np.array([1.5], np.float32),
                          after_video="transformers")
    assert pos[0, 2:14].tolist() == [2] * 4 + [3] * 4 + [5] * 4
    assert pos[1, 2:6].tolist() == [2, 2, 3, 3] and pos[2, 2:6].tolist() == [2, 3, 2, 3]
    assert pos[:, 14].tolist() == [4, 4, 4]  # text continues at 2 + max(h', w') = 4


# ---------------------------------------------------------------- against transformers'
# video processors (need torchvision)


def _hf_processor(fam: str, **kw):
    pytest.importorskip("torchvision")
    if family(fam).video_style == "qwen3":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor as Processor,
        )
    else:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import (
            Qwen2VLVideoProcessor as Processor,
        )
    return Processor(patch_size=family(fam).patch_size, **kw)


@pytest.mark.parametrize("fam", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("cap", [True, False])
def test_sampling_and_pixels_match_transformers_on_a_file(fam: str, cap: bool) -> None:
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (37, 70, 130, 3), dtype=np.uint8)
    meta = vid.VideoMeta(total_frames=37, fps=12.0, width=130, height=70)
    settings = vid.VideoSettings(cap_pixels_per_frame=cap)
    indices = vid.sample_indices(fam, meta, settings)
    h, w = vid.frame_size(fam, len(indices), 70, 130, settings)
    t = -(-len(indices) // 2)
    plan = vid.VideoPlan(indices, h, w, (t, h // family(fam).patch_size,
                                         w // family(fam).patch_size), 0.0, ())
    norm = (0.5,) * 3 if family(fam).image_norm else (
        (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    mean, std = (norm, norm) if family(fam).image_norm else norm
    ours = vid.patches(frames[list(indices)], plan, fam, mean, std)
    proc = _hf_processor(fam, do_sample_frames=True, fps=2, min_frames=4, max_frames=768,
                         cap_pixels_per_frame=cap)
    out = proc(videos=[frames], video_metadata=[{"total_num_frames": 37, "fps": 12.0,
                                                 "width": 130, "height": 70}],
               return_tensors="pt", return_metadata=True)
    assert list(out["video_metadata"][0].frames_indices) == list(indices)
    assert out["video_grid_thw"][0].tolist() == list(plan.grid)
    np.testing.assert_allclose(ours, out["pixel_values_videos"].numpy(), atol=2e-5)


@pytest.mark.parametrize("fam", ["qwen2_5_vl", "qwen3_vl"])
def test_encoded_video_sample_matches_transformers_processor(tmp_path: Path, fam: str) -> None:
    """Our tokens, grids, pixels and timing of a frame-list video equal what transformers'
    processor makes of the same frames and the same chat text."""
    pytest.importorskip("torchvision")
    names = _frames(tmp_path, 5, size=(70, 130))
    enc = Encoder(fam)
    s = enc.encode(_conv(tmp_path, [{"type": "text", "text": "what?"},
                                    {"type": "video", "video": names, "fps": 2}]))
    frames = np.stack([np.asarray(Image.open(tmp_path / n).convert("RGB")) for n in names])
    if fam == "qwen3_vl":
        from transformers import Qwen3VLProcessor as Processor
    else:
        from transformers import Qwen2_5_VLProcessor as Processor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    vp = _hf_processor(fam, do_sample_frames=False, cap_pixels_per_frame=True,
                       **({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
                          if family(fam).image_norm else {}))
    processor = Processor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=enc.tokenizer,
                          video_processor=vp, chat_template=None)
    prompt = enc.tokenizer.decode(s.input_ids)
    # the chat template's text: the video's expansion back to one <|video_pad|>
    text = re.sub(r"<\|vision_start\|>((<[0-9.]+ seconds>)?<\|vision_start\|>(<\|video_pad\|>)+"
                  r"<\|vision_end\|>)+<\|vision_end\|>|<\|vision_start\|>(<\|video_pad\|>)+"
                  r"<\|vision_end\|>", "<|vision_start|><|video_pad|><|vision_end|>", prompt)
    assert text.count("<|video_pad|>") == 1
    out = processor(text=[text], videos=[frames], videos_kwargs={
        "video_metadata": [{"total_num_frames": 5, "fps": 2.0, "frames_indices": list(range(5))}],
        "return_metadata": True}, return_tensors="pt")
    np.testing.assert_array_equal(out["input_ids"][0].numpy(), s.input_ids)
    hf = s.hf_visuals()
    np.testing.assert_array_equal(out["video_grid_thw"].numpy(), hf["video_grid_thw"])
    np.testing.assert_allclose(out["pixel_values_videos"].numpy(), hf["pixel_values_videos"],
                               atol=2e-5)
    if fam == "qwen2_5_vl":
        np.testing.assert_allclose(np.asarray(out["second_per_grid_ts"], np.float32),
                                   hf["second_per_grid_ts"])


def _video_folder(tmp_path: Path, **cfg) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(cfg))
    return folder


def test_folder_video_settings_apply_and_user_settings_win(tmp_path: Path) -> None:
    folder = _video_folder(tmp_path, fps=1, min_frames=2, max_frames=6, patch_size=16,
                           size={"shortest_edge": 4096, "longest_edge": 65536},
                           cap_pixels_per_frame=False)
    enc = Encoder("qwen3_vl", processor_path=str(folder))
    assert enc.video_file == str(folder / "video_preprocessor_config.json")
    assert (enc.video.fps, enc.video.max_frames, enc.video.min_pixels, enc.video.max_pixels,
            enc.video.cap_pixels_per_frame) == (1.0, 6, 4096, 65536, False)
    mine = Encoder("qwen3_vl", processor_path=str(folder), video=vid.VideoSettings(fps=0.5))
    assert (mine.video.fps, mine.video.max_frames) == (0.5, 6)
    # 40 frames at 10 fps: 4 s at 1 fps → 4 frames; at 0.5 fps → 2, raised to min_frames 2
    meta = vid.VideoMeta(total_frames=40, fps=10.0, width=64, height=64)
    assert len(vid.sample_indices("qwen3_vl", meta, enc.video)) == 4
    assert len(vid.sample_indices("qwen3_vl", meta, mine.video)) == 2
    bad = _video_folder(tmp_path, patch_size=14)
    with pytest.raises(ValueError, match=r"video_preprocessor_config\.json: patch_size=14"):
        Encoder("qwen3_vl", processor_path=str(bad))


def test_folder_video_settings_match_transformers_loading_the_same_file(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folder = _video_folder(tmp_path, fps=1, min_frames=2, max_frames=6, patch_size=16,
                           temporal_patch_size=2, merge_size=2, cap_pixels_per_frame=True,
                           size={"shortest_edge": 4096, "longest_edge": 200000},
                           image_mean=[0.5] * 3, image_std=[0.5] * 3)
    enc = Encoder("qwen3_vl", processor_path=str(folder))
    hf = Qwen3VLVideoProcessor.from_pretrained(str(folder), local_files_only=True)
    frames = np.random.default_rng(5).integers(0, 256, (50, 90, 160, 3), dtype=np.uint8)
    meta = vid.VideoMeta(total_frames=50, fps=10.0, width=160, height=90)
    indices = vid.sample_indices("qwen3_vl", meta, enc.video)
    out = hf(videos=[frames], video_metadata=[{"total_num_frames": 50, "fps": 10.0}],
             return_tensors="pt", return_metadata=True)
    assert list(out["video_metadata"][0].frames_indices) == list(indices)
    h, w = vid.frame_size("qwen3_vl", len(indices), 90, 160, enc.video)
    assert out["video_grid_thw"][0].tolist() == [-(-len(indices) // 2), h // 16, w // 16]
