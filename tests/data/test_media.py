"""The media-path policy and the decode check: a dataset cannot pull files from outside its media
root into a shard or a run, and `energon-prepare` packages only media that decode."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlpack.cli import main
from vlpack.config import load_config
from vlpack.data.encode import Encoder
from vlpack.data.energon.prepare import prepare_energon
from vlpack.data.loader import build_loaders, open_dataset
from vlpack.data.media import (
    BAD_PATH,
    ORIENTATION,
    OUTSIDE_ROOT,
    DataFile,
    image_size,
    media_path,
    open_image,
)
from vlpack.data.sources import iter_jsonl
from vlpack.data.types import BadSampleError, Conversation, ImageRef, Message


def _rec(i: str, image: str) -> str:
    return json.dumps({"id": i, "messages": [
        {"role": "user", "content": [{"type": "image", "image": image},
                                     {"type": "text", "text": "Total?"}]},
        {"role": "assistant", "content": "12.50"}]})  # fmt: skip


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ (the media root) holding data/set.jsonl, data/ok.png, shared.png, a symlink out
    of root and one within it, and a text file named .jpg; outside/secret.png beside root."""
    root, data = tmp_path / "root", tmp_path / "root" / "data"
    data.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(data / "ok.png")
    Image.new("RGB", (64, 48), (10, 200, 10)).save(root / "shared.png")
    Image.new("RGB", (64, 48), (1, 2, 3)).save(tmp_path / "outside" / "secret.png")
    os.symlink(tmp_path / "outside" / "secret.png", data / "escape.png")
    os.symlink(data / "ok.png", data / "inside.png")
    (data / "fake.jpg").write_text("root:x:0:0:root:/root:/bin/bash\n")
    lines = [_rec("ok", "ok.png"), _rec("passwd", "/etc/passwd"),
             _rec("dotdot", "../../outside/secret.png"), _rec("up_in_root", "../shared.png"),
             _rec("symlink", "escape.png"), _rec("link_in", "inside.png"),
             _rec("fake", "fake.jpg")]  # fmt: skip
    (data / "set.jsonl").write_text("\n".join(lines) + "\n")
    return data / "set.jsonl"


def _verdicts(path: Path, media_root=None) -> dict[str, str]:
    """{key: "ok" or the reason} of every record as the JSONL path reads it, its media inside
    `media_root` (None: its folder)."""
    out = {}
    for i, item in enumerate(iter_jsonl(DataFile.of(path, media_root))):
        key = item.key if not isinstance(item, BadSampleError) else str(item).split(":")[0]
        out[key or str(i)] = item.reason if isinstance(item, BadSampleError) else "ok"
    return out


def test_default_root_is_the_jsonl_folder(tree: Path) -> None:
    assert _verdicts(tree) == {
        "ok": "ok", "passwd": OUTSIDE_ROOT, "dotdot": OUTSIDE_ROOT, "up_in_root": OUTSIDE_ROOT,
        "symlink": OUTSIDE_ROOT, "link_in": "ok", "fake": "ok"}  # fmt: skip
    (err,) = [e for e in iter_jsonl(tree) if isinstance(e, BadSampleError)
              and str(e).startswith("passwd")]
    assert "'/etc/passwd'" in str(err) and "data.media_root" in str(err)


def test_media_root_widens_and_bounds(tree: Path) -> None:
    """Under root/, `../shared.png` is in and `../../outside/...` is still out; a symlink is
    judged by where it points."""
    v = _verdicts(tree, tree.parent.parent)
    assert v["up_in_root"] == "ok" and v["link_in"] == "ok"
    assert v["dotdot"] == v["symlink"] == v["passwd"] == OUTSIDE_ROOT


def test_training_reads_with_the_same_policy(tree: Path) -> None:
    cfg = load_config(None, ["data.source=jsonl", f"data.path={tree}", "model.init=random",
                             f"data.media_root={tree.parent.parent}"])
    assert cfg.data.media_root == str(tree.parent.parent)
    train, _ = build_loaders(cfg.data, Encoder("qwen3_vl"), seed=0, pad_token_id=0,
                             spatial_merge_size=2)  # what the trainer calls
    bad = {str(e).split(":")[0] for e in train.items if isinstance(e, BadSampleError)}
    assert bad == {"passwd", "dotdot", "symlink"}  # ../shared.png is inside data.media_root
    items = open_dataset("jsonl", str(tree))  # the default root: the JSONL file's folder
    assert sum(isinstance(e, BadSampleError) for e in items) == 4
    with pytest.raises(ValueError, match=r"data\.media_root bounds"):
        load_config(None, ["data.source=synthetic", "data.media_root=/tmp"])


def test_each_mixture_source_bounds_its_media_by_its_own_folder(tmp_path: Path) -> None:
    """`data.mix` builds a `DataFile` per source: by default each source's root is its own
    folder (a's image is out of b's root), and one `data.media_root` bounds them all."""
    from vlpack.config import DataConfig, MixSource
    from vlpack.data.loader import open_mix

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / name / "x.png")
    _write(tmp_path / "a", _rec("a_own", "x.png"))
    _write(tmp_path / "b", _rec("b_own", "x.png"), _rec("b_in_a", "../a/x.png"))
    mix = [MixSource(path=str(tmp_path / n / "set.jsonl"), name=n) for n in ("a", "b")]

    def verdicts(**kw) -> list[str]:
        items = open_mix(DataConfig(source="synthetic", mix=mix, **kw), seed=0)
        return [getattr(e, "reason", "ok") for rows in items.sources for e in rows]

    assert verdicts() == ["ok", "ok", OUTSIDE_ROOT]
    assert verdicts(media_root=str(tmp_path)) == ["ok", "ok", "ok"]
    assert [rows.file.root for rows in open_mix(DataConfig(source="synthetic", mix=mix), 0)
            .sources] == [(tmp_path / n).resolve() for n in ("a", "b")]
    with pytest.raises(ValueError, match="already has its media root"):
        DataFile.of(DataFile.of(tmp_path / "a" / "set.jsonl"), tmp_path)


def _members(out: Path) -> dict[str, bytes]:
    got = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            got |= {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    return got


def test_energon_prepare_packages_nothing_that_escapes_or_lies(tree: Path, capsys) -> None:
    out = tree.parent.parent.parent / "ds"
    assert main(["data", "energon-prepare", str(tree), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"left out: {OUTSIDE_ROOT}: passwd: image '/etc/passwd'" in printed  # refused by name
    assert "fake: image" in printed and "does not decode as an image" in printed
    report = json.loads((out / "vlpack-prepare.json").read_text())
    assert report["samples"] == 2  # ok, link_in
    assert report["skipped"] == {OUTSIDE_ROOT: 4, "corrupt_image": 1}
    members = _members(out)
    assert sorted(n for n in members if not n.endswith(".json")) == [
        "000000000.img0.png", "000000001.img0.png"]
    assert not any(b"root:" in b for b in members.values())
    # With every path allowed, /etc/passwd still does not enter a shard: it does not decode.
    lax = prepare_energon(DataFile.of(tree, "/"), tree.parent.parent.parent / "lax")
    reasons = {p["message"].split(":")[0]: p["reason"] for p in lax["problems"]}
    assert reasons == {"passwd": "corrupt_image", "fake": "corrupt_image"}
    assert lax["samples"] == 5
    assert not any(b"root:" in b for b in _members(tree.parent.parent.parent / "lax").values())


def test_member_is_named_by_the_decoded_format(tmp_path: Path) -> None:
    """A PNG named .jpg decodes, and its member says .png: a shard never claims a wrong type."""
    Image.new("RGB", (64, 48)).save(tmp_path / "really_png.jpg", format="PNG")
    (tmp_path / "d.jsonl").write_text(_rec("a", "really_png.jpg") + "\n")
    prepare_energon(tmp_path / "d.jsonl", tmp_path / "ds")
    assert "000000000.img0.png" in _members(tmp_path / "ds")


def test_an_unusable_path_is_a_named_skip(tmp_path: Path) -> None:
    """A path the OS cannot resolve (a NUL byte, a symlink loop) is a bad sample named by its
    record, not an error that stops the run."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "set.jsonl").write_text(_rec("nul", "a\u0000b.png") + "\n"
                                        + _rec("loop", "loop/x.png") + "\n")
    got = list(iter_jsonl(tmp_path / "set.jsonl"))
    assert len(got) == 2 and all(isinstance(x, BadSampleError) for x in got), got
    assert "nul" in str(got[0]) and "loop" in str(got[1])


def test_media_path_returns_what_it_checked(tmp_path: Path) -> None:
    """The resolved path, not the joined one: a later open reads the file that was checked,
    even if a symlink on the way is swapped in between."""
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "link.png").symlink_to(tmp_path / "a.png")
    real = (tmp_path / "a.png").resolve()
    assert media_path("link.png", tmp_path, tmp_path.resolve(), "k", "image") == real
    assert media_path("sub/../a.png", tmp_path, tmp_path.resolve(), "k", "image") == real
    conv = next(iter_jsonl(_write(tmp_path, _rec("l", "link.png"))))
    assert conv.images[0].path == real
    # a missing file passes here, resolved; its reader names it missing
    gone = media_path("gone.png", tmp_path, tmp_path.resolve(), "k", "image")
    assert gone == tmp_path.resolve() / "gone.png"


def _write(folder: Path, *lines: str) -> Path:
    (folder / "set.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder / "set.jsonl"


def test_a_name_too_long_a_fifo_or_a_folder_is_a_named_skip(tmp_path: Path) -> None:
    """A name the OS cannot stat (ENAMETOOLONG) and an entry that is no regular file are bad
    samples, checked before anything is opened: a FIFO would block its reader for ever."""
    import threading

    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "dir.png").mkdir()
    long = "x" * 300 + ".png"
    path = _write(tmp_path, _rec("long", long), _rec("fifo", "pipe.png"), _rec("dir", "dir.png"))
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(iter_jsonl(path)), daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert not reader.is_alive(), "reading the records blocked (opened the FIFO?)"
    assert [(type(e).__name__, getattr(e, "reason", None)) for e in got] == [
        ("BadSampleError", BAD_PATH)] * 3, got
    assert "File name too long" in str(got[0]) and "(304 chars)" in str(got[0])
    assert "not a regular file" in str(got[1]) and "'pipe.png'" in str(got[1])
    assert str(got[2]).startswith("dir: image 'dir.png' is not a regular file")


def _eps(path: Path) -> Path:
    """A tiny EPS file (Pillow would rasterise it with Ghostscript)."""
    path.write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n"
                    "newpath 0 0 moveto 64 64 lineto stroke\nshowpage\n")
    return path


def test_only_raster_formats_are_opened(tmp_path: Path) -> None:
    """EPS named .jpg is a bad image, never handed to Ghostscript, in training and in
    energon-prepare; a phone's MPO JPEG still opens."""
    pic = _eps(tmp_path / "pic.jpg")
    with Image.open(pic) as im:  # what Pillow makes of it unasked
        assert im.format == "EPS"
    ref = ImageRef(pic)
    for call in (image_size, open_image):
        with pytest.raises(BadSampleError, match="cannot identify image") as e:
            call("k", ref)
        assert e.value.reason == "corrupt_image"
    mpo = tmp_path / "phone.jpg"
    Image.new("RGB", (40, 30), (9, 9, 9)).save(mpo, format="MPO", save_all=True,
                                               append_images=[Image.new("RGB", (40, 30))])
    assert image_size("k", ImageRef(mpo)) == (40, 30)
    assert open_image("k", ImageRef(mpo)).size == (40, 30)
    report = prepare_energon(_write(tmp_path, _rec("eps", "pic.jpg"), _rec("mpo", "phone.jpg")),
                             tmp_path / "ds")
    assert report["samples"] == 1 and report["skipped"] == {"corrupt_image": 1}, report


def test_a_record_naming_media_twice_is_skipped_not_a_crash(tmp_path: Path) -> None:
    """"image" and "images" (or "video" and "videos") in one record: ambiguous, a bad_schema
    skip in training and in energon-prepare (which otherwise renamed a path it never read)."""
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    ask = [{"from": "human", "value": "<image>\nTotal?"}, {"from": "gpt", "value": "1"}]
    both = {"id": "both", "conversations": ask, "image": "a.png", "images": ["a.png"]}
    ok = {"id": "ok", "conversations": ask, "image": "a.png"}
    (tmp_path / "set.jsonl").write_text(json.dumps(both) + "\n" + json.dumps(ok) + "\n")
    bad, good = list(iter_jsonl(tmp_path / "set.jsonl"))
    assert isinstance(bad, BadSampleError) and bad.reason == "bad_schema" and "both" in str(bad)
    assert not isinstance(good, BadSampleError)
    report = prepare_energon(tmp_path / "set.jsonl", tmp_path / "out")
    assert report["samples"] == 1 and report["skipped"] == {"bad_schema": 1}, report


# --- EXIF orientation --------------------------------------------------------------------------------
# EXIF orientation: a phone photo stored 300×200 with orientation 6 trains upright, as transformers'
# `load_image` gives it, and every length measured from its header follows.
def _photo(path: Path, orientation: int, fmt: str = "JPEG") -> Path:
    """A 300×200 picture, left half red, with the EXIF orientation `orientation`."""
    a = np.zeros((200, 300, 3), np.uint8)
    a[:, :150, 0] = 255
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    Image.fromarray(a).save(path, format=fmt, exif=exif.tobytes())
    return path


def _conv(path: Path) -> Conversation:
    return Conversation("k", (Message("user", (ImageRef(path), "Which side is red?")),
                              Message("assistant", ("left",))))


@pytest.fixture(scope="module")
def enc() -> Encoder:
    return Encoder("qwen3_vl", min_pixels=16384, max_pixels=50176)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_encoded_as_transformers_loads_it(enc: Encoder, tmp_path: Path, orientation: int) -> None:
    from transformers.image_utils import load_image

    path = _photo(tmp_path / "p.jpg", orientation)
    upright = load_image(str(path))  # transformers: exif_transpose, then RGB
    assert upright.size == ((200, 300) if orientation in (6, 8) else (300, 200))
    ref = enc.image_processor(images=[upright], return_tensors=None)
    s = enc.encode(_conv(path))
    assert s.image_grid_thw.tolist() == np.asarray(ref["image_grid_thw"]).tolist()
    np.testing.assert_array_equal(s.pixel_values, np.asarray(ref["pixel_values"], np.float32))
    assert enc.measure(_conv(path)) == s.size  # the header's size is the upright one


def test_png_with_exif_in_its_header(enc: Encoder, tmp_path: Path) -> None:
    path = _photo(tmp_path / "p.png", 6, fmt="PNG")
    s = enc.encode(_conv(path))
    _, h, w = s.image_grid_thw[0].tolist()
    assert h > w and enc.measure(_conv(path)) == s.size


def test_orientation_known_only_after_the_pixels_is_refused(enc: Encoder, tmp_path: Path) -> None:
    """A PNG whose eXIf chunk follows the pixel data: its header size is not its upright size,
    so the encoder refuses it rather than overfill a bin planned from the header."""
    import struct
    import zlib

    path = _photo(tmp_path / "late.png", 1, fmt="PNG")
    Image.open(path).save(path, format="PNG")  # no EXIF at all
    data = path.read_bytes()
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    body = exif.tobytes()[6:] if exif.tobytes().startswith(b"Exif\0\0") else exif.tobytes()
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(
        ">I", zlib.crc32(b"eXIf" + body))
    iend = data.rindex(b"IEND") - 4
    path.write_bytes(data[:iend] + chunk + data[iend:])
    with Image.open(path) as im:  # Pillow sees the orientation only once it has decoded
        im.load()
        assert im.getexif().get(ORIENTATION) == 6
    with pytest.raises(BadSampleError, match="stored after the pixel data") as info:
        enc.encode(_conv(path))
    assert info.value.reason == "corrupt_image"


# --- the boundary's edge: names that extend the root, `..` in and out, links, spellings of the root --
# The root is `media/`; beside it lie `media_x/` and `media2/`, whose names begin with the root's
# (a string-prefix test takes them for inside), and `link_out.png` in the root points into
# `media_x/`. Every spelling of the root (trailing slash, relative, `./`, `..` in it, a symlink
# to it) bounds the same files.
_EDGES = {  # record id: (its path, {TMP} replaced by the test folder; the verdict)
    "plain": ("a.png", "ok"),
    "sub": ("sub/b.png", "ok"),
    "down_up": ("sub/../a.png", "ok"),
    "out_and_back_in": ("../media/a.png", "ok"),
    "deep_out_and_back_in": ("sub/../../media/sub/b.png", "ok"),
    "sibling_x": ("../media_x/a.png", OUTSIDE_ROOT),
    "sibling_2": ("../media2/a.png", OUTSIDE_ROOT),
    "sibling_folder": ("../media_x", OUTSIDE_ROOT),
    "parent": ("..", OUTSIDE_ROOT),
    "abs_inside": ("{TMP}/media/a.png", "ok"),
    "abs_sibling": ("{TMP}/media_x/a.png", OUTSIDE_ROOT),
    "abs_sibling_2": ("{TMP}/media2/a.png", OUTSIDE_ROOT),
    "abs_via_sibling_back_in": ("{TMP}/media_x/../media/a.png", "ok"),
    "abs_via_root_out": ("{TMP}/media/../media2/a.png", OUTSIDE_ROOT),
    "link_out": ("link_out.png", OUTSIDE_ROOT),
    "link_in": ("link_in.png", "ok"),
    "root_itself": (".", BAD_PATH),  # inside, but a folder
    "root_by_name": ("../media", BAD_PATH),
}


@pytest.fixture
def edges(tmp_path: Path) -> Path:
    """tmp/media/{set.jsonl, a.png, sub/b.png, link_out.png → ../media_x/a.png, link_in.png →
    sub/b.png}, tmp/media_x/a.png, tmp/media2/a.png and tmp/alias → media."""
    media = tmp_path / "media"
    for folder in (media / "sub", tmp_path / "media_x", tmp_path / "media2"):
        folder.mkdir(parents=True)
    for f in (media / "a.png", media / "sub" / "b.png", tmp_path / "media_x" / "a.png",
              tmp_path / "media2" / "a.png"):
        Image.new("RGB", (8, 8)).save(f)
    (media / "link_out.png").symlink_to(Path("..") / "media_x" / "a.png")
    (media / "link_in.png").symlink_to(Path("sub") / "b.png")
    (tmp_path / "alias").symlink_to(media)
    return _write(media, *(_rec(k, p.replace("{TMP}", str(tmp_path)))
                           for k, (p, _) in _EDGES.items()))


@pytest.mark.parametrize("spelling", [None, "{TMP}/media", "{TMP}/media/", "media", "media/",
                                      "./media", "./media/", "media/sub/..", "{TMP}/alias",
                                      "alias/"])
def test_every_spelling_of_the_root_bounds_the_same_files(edges: Path, spelling: str | None,
                                                         monkeypatch) -> None:
    monkeypatch.chdir(edges.parent.parent)  # relative spellings are relative to the cwd
    root = None if spelling is None else spelling.replace("{TMP}", str(edges.parent.parent))
    assert _verdicts(edges, root) == {k: v for k, (_, v) in _EDGES.items()}


def test_media_path_bounds_by_path_not_by_prefix(edges: Path) -> None:
    """`media_path` itself, its root resolved as callers give it: a sibling whose name extends
    the root's is outside, whatever way it is named."""
    tmp = edges.parent.parent
    root = (tmp / "media").resolve()
    for raw in ("../media_x/a.png", f"{tmp}/media2/a.png", "link_out.png", "../media2"):
        with pytest.raises(BadSampleError, match="outside the media root") as e:
            media_path(raw, tmp / "media", root, "k", "image")
        assert e.value.reason == OUTSIDE_ROOT
    assert media_path("../media/sub/../a.png", tmp / "media", root, "k", "image") == root / "a.png"
    # a root of media_x: media/ and media2/ are outside it too
    inner = (tmp / "media_x").resolve()
    with pytest.raises(BadSampleError) as e:
        media_path("../media/a.png", tmp / "media_x", inner, "k", "image")
    assert e.value.reason == OUTSIDE_ROOT


def test_an_inline_data_uri_is_named_with_its_fix(tmp_path: Path) -> None:
    """A `data:` URI in an image field is no missing file: the record is refused as an inline
    URI, with the fix (the image as a file next to the JSONL)."""
    uri = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4D"
           "wABBAEAcCBlCwAAAABJRU5ErkJggg==")
    (bad,) = iter_jsonl(_write(tmp_path, _rec("u", uri)))
    assert isinstance(bad, BadSampleError) and bad.reason == BAD_PATH
    assert str(bad) == (
        "u: image 'data:image/png;base64,iVBORw0KGgoAAAANSU…' is an inline data: URI, which "
        "vlpack does not read: write the image to a file next to the JSONL file and name that "
        f'file in the record (e.g. "images/0001.png") [{tmp_path / "set.jsonl"}:1]')
    with pytest.raises(BadSampleError, match=r'video .* \(e\.g\. "videos/0001\.mp4"\)'):
        media_path("data:video/mp4;base64,AAAA", tmp_path, tmp_path.resolve(), "k", "video")
    with pytest.raises(BadSampleError, match=r'\(e\.g\. "images/0001\.jpg"\)'):
        media_path("data:image/jpeg;base64,/9j/", tmp_path, tmp_path.resolve(), "k", "image")
