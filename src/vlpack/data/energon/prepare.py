"""`vlpack data energon-prepare`: JSONL conversations → WebDataset shards Energon can read.

Each sample of a shard holds the record as `KEY.json` (image and video paths rewritten to the
sample's own members) and its files: images as `KEY.img0.jpg`, `KEY.img1.png`, ..., video files
as `KEY.vid0.mp4`, the frames of a frame-list video as `KEY.vid1f000.jpg`, `KEY.vid1f001.jpg`,
... (bytes copied verbatim, never re-encoded). The record keeps its vlpack key in `id` (the
JSONL path's `file:line` when the record had none), so both paths name samples alike.

Nothing is packaged that the dataset merely names: media paths must resolve inside the media
root (the `DataFile`'s, by default the JSONL file's folder; `vlpack.data.media`), and every file's
bytes must decode as what it claims before they are written: an image or frame must decode in
full with Pillow as one of vlpack's image formats (its member is named by the decoded format,
`.jpg` for JPEG, `.png` for PNG, ...), a video file must open with PyAV as one of vlpack's
containers (`video.VIDEO_CONTAINERS`) and decode its first frame. Records that cannot be
parsed, whose paths escape the root, or whose files are missing or do not decode are left out
and counted by reason, as are records whose text holds a special token of a supported family's
tokenizer (`special_token_in_text`: training would refuse them one by one).

Energon's own `energon prepare` then indexes the shards, writes the split (all train) and a
`dataset.yaml` for a crude dataset (`CrudeWebdataset`), cooked by vlpack's task encoder.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlpack.data.energon import require_energon
from vlpack.data.media import BAD_PATH, DataFile
from vlpack.data.sources import iter_jsonl_lines
from vlpack.data.types import BadSampleError, Conversation, ImageRef, printable

REPORT_NAME = "vlpack-prepare.json"
"""Written into OUT_DIR: sample and shard counts, and what was left out by reason."""


def prepare_energon(
    file: DataFile | str | Path, out_dir: str | Path, *, shard_size: int = 1000,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Write shards of `file` (a JSONL file) into `out_dir` and run `energon prepare` on them;
    returns the report (also saved as `out_dir/vlpack-prepare.json`). Media paths must resolve
    inside the file's media root (a bare path: the JSONL file's folder)."""
    require_energon("vlpack data energon-prepare")
    file, out = DataFile.of(file), Path(out_dir)
    data = file.path
    if shard_size < 1:
        raise ValueError(f"--shard-size must be ≥ 1 sample, got {shard_size}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: give a new or empty folder for the Energon dataset")
    out.mkdir(parents=True, exist_ok=True)
    shards, n, problems = _write_shards(file, out, shard_size)
    skipped = Counter(p["reason"] for p in problems)
    if not n:
        first = "".join(f"\n  {p['reason']}: {printable(p['message'])}" for p in problems[:5])
        raise ValueError(f"{data}: no usable sample (left out: {dict(skipped)}); fix the "
                         f"records{first}")
    _energon_prepare(out, workers=min(shards, os.cpu_count() or 1), show_progress=show_progress)
    report = {"data": str(data.absolute()), "samples": n, "shards": shards,
              "shard_size": shard_size, "skipped": dict(sorted(skipped.items())),
              "problems": problems}  # fmt: skip
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _write_shards(file: DataFile, out: Path, shard_size: int
                  ) -> tuple[int, int, list[dict[str, str]]]:
    """Shards `shard-000000.tar`, ... of `shard_size` samples; returns (shards, samples, the
    left-out records as {"reason", "message"} in file order)."""
    problems: list[dict[str, str]] = []
    n = 0
    tar: tarfile.TarFile | None = None
    try:
        for raw, item in iter_jsonl_lines(file):
            if isinstance(item, BadSampleError):
                problems.append({"reason": item.reason, "message": str(item)})
                continue
            assert raw is not None  # a record that parsed was read whole
            try:
                _refuse_special_tokens(item)
                record = json.loads(raw.decode("utf-8-sig"))  # as parse_line read it
                members = _sample_members(record, item, file.folder)
            except BadSampleError as e:
                problems.append({"reason": e.reason, "message": str(e)})
                continue
            if n % shard_size == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(out / f"shard-{n // shard_size:06d}.tar", "w")
            assert tar is not None
            for name, payload in members.items():
                _add(tar, f"{n:09d}.{name}", payload)
            n += 1
    finally:
        if tar is not None:
            tar.close()
    return -(-n // shard_size), n, problems


def _refuse_special_tokens(conv: Conversation) -> None:
    """BadSampleError `special_token_in_text` when the conversation's text holds a special
    token of any supported family's built-in tokenizer (grounding markup aside), as training's
    `Encoder` refuses it for its family."""
    from vlpack.data import tools
    from vlpack.data.encode import refuse_control_tokens
    from vlpack.data.types import Message

    control, whose = _control_tokens(), "a supported family's tokenizer"
    for i, m in enumerate(conv.messages):
        refuse_control_tokens(conv.key, i, m, control, whose)
    refuse_control_tokens(conv.key, None, Message("tools", (tools.tojson(conv.tools),)), control,
                          whose)


@functools.cache
def _control_tokens() -> re.Pattern:
    """The special tokens of every family's built-in tokenizer, grounding markup aside."""
    from vlpack.data.encode import GROUNDING_TOKENS
    from vlpack.data.tokenizer import builtin_special_tokens

    return re.compile("|".join(map(re.escape, sorted(
        builtin_special_tokens().difference(GROUNDING_TOKENS)))))


def _sample_members(obj: dict, conv: Conversation, base: Path) -> dict[str, bytes]:
    """{"json": record, "img0.jpg": bytes, "vid0.mp4": bytes, ...} for one sample (one member
    per distinct file)."""
    from PIL import Image

    names: dict[Path, str] = {}
    files: dict[str, bytes] = {}

    def add(path: Path, name: str, kind: str, what: str) -> None:
        if path in names:
            return
        missing, corrupt = ("missing_image", "corrupt_image") if kind == "image" else \
            ("missing_video", "corrupt_video")
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            raise BadSampleError(missing, f"{conv.key}: {what} {path} not found") from None
        except OSError as e:
            raise BadSampleError(missing, f"{conv.key}: {what} {path} cannot be read "
                                 f"({type(e).__name__}: {e})") from None
        try:
            suffix = _decoded_video_suffix(payload, path) if kind == "video" else \
                _decoded_image_suffix(payload)
        except ImportError:
            raise BadSampleError("video_decoder_missing", f"{conv.key}: video {path}: checking "
                                 "that it decodes before packaging it needs PyAV: pip install "
                                 "'vlpack[video]'") from None
        except Image.DecompressionBombError as e:
            raise BadSampleError("image_too_large", f"{conv.key}: {what} {path} is larger than "
                                 f"Pillow's decompression-bomb limit ({e}): downscale it") from None
        except Exception as e:  # Pillow and PyAV raise many types on bad bytes
            raise BadSampleError(
                corrupt, f"{conv.key}: {what} {path} does not decode as "
                f"{'a video' if kind == 'video' else 'an image'} ({type(e).__name__}: {e}); "
                "only media that decode are packaged: fix or drop the file") from None
        files[name + suffix] = payload
        names[path] = name + suffix

    n_image = n_video = 0
    for ref in conv.visuals:
        if isinstance(ref, ImageRef):
            if ref.path not in names:
                add(ref.path, f"img{n_image}", "image", "image")
                n_image += 1
            continue
        for j, frame in enumerate(ref.frames):
            add(frame, f"vid{n_video}f{j:03d}", "frame", "video frame")
        if ref.path is not None:
            add(ref.path, f"vid{n_video}", "video", "video")
        n_video += 1

    def rename(p: str) -> str:  # the refs hold resolved paths (`media.media_path`)
        if (name := names.get((base / p).resolve())) is None:
            raise BadSampleError(BAD_PATH, f"{conv.key}: media path {p!r} changed while "
                                 "the sample was packaged: run again")
        return name

    record = _rewrite_paths(obj, rename)
    record["id"] = conv.key
    return {"json": json.dumps(record, ensure_ascii=False).encode(), **files}


_SUFFIX = {"JPEG": ".jpg", "MPO": ".jpg", "TIFF": ".tif"}
"""Member suffix of a Pillow format whose name is not its usual suffix (else `.format`)."""


def _decoded_image_suffix(payload: bytes) -> str:
    """Decode `payload` in full as an image of `media.IMAGE_FORMATS` (Pillow's
    decompression-bomb limit applies); the member suffix of its format."""
    from vlpack.data.media import open_raster

    with open_raster(io.BytesIO(payload)) as image:
        image.load()
        return _SUFFIX.get(image.format, f".{image.format.lower()}")


def _decoded_video_suffix(payload: bytes, path: Path) -> str:
    """Open `payload` with PyAV as one of `video.VIDEO_CONTAINERS` and decode its first video
    frame; the file's own suffix (ImportError without PyAV)."""
    from vlpack.data.video import open_container

    with open_container(io.BytesIO(payload)) as container:
        next(container.decode(video=0))
    return path.suffix.lower() or ".video"


def _rewrite_paths(obj: dict, rename: Callable[[str], str]) -> dict:
    """A copy of a record with every image and video path renamed, in the places
    `parse_record` reads them: top-level `image`/`images`/`video`/`videos`, and the paths of
    messages' content items."""

    def paths(v):  # a path, or a (nested) list of them
        if isinstance(v, str):
            return rename(v)
        return [paths(p) for p in v] if isinstance(v, list) else v

    record = dict(obj)
    for k in ("image", "images", "video", "videos"):
        if k in record:
            record[k] = paths(record[k])
    if isinstance(record.get("messages"), list):
        record["messages"] = [_rewrite_message(m, rename) for m in record["messages"]]
    return record


def _rewrite_message(message: dict, rename: Callable[[str], str]) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    items = []
    for item in content:
        if isinstance(item, dict) and item.get("type") in ("image", None):
            item = dict(item)
            for k in ("image", "path"):
                if isinstance(item.get(k), str) and item[k]:
                    item[k] = rename(item[k])
                    break
        elif isinstance(item, dict) and item.get("type") == "video":
            item = dict(item)
            v = item.get("video")
            item["video"] = rename(v) if isinstance(v, str) else [rename(p) for p in v]
        items.append(item)
    return {**message, "content": items}


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(payload), 0o644, 0  # reproducible shards
    tar.addfile(info, io.BytesIO(payload))


def _energon_prepare(out: Path, *, workers: int, show_progress: bool) -> None:
    """Energon's own `energon prepare`, non-interactive: tar index, an all-train split and a
    dataset.yaml for a crude dataset."""
    cmd = [sys.executable, "-m", "megatron.energon.cli.main", "prepare", str(out),
           "--non-interactive", "--force-overwrite", "--split-ratio", "1,0,0",
           "--sample-type", "CrudeWebdataset", "--num-workers", str(max(workers, 1)),
           "--progress" if show_progress else "--no-progress"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not (out / ".nv-meta" / "dataset.yaml").is_file():
        raise RuntimeError(
            f"`energon prepare` failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
        )
