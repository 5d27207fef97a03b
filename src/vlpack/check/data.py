"""The samples `vlpack check` packs: the synthetic mix, or the user's `--data` file encoded as
training encodes it, with ids the checked model can read."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from vlpack.data.media import DataFile
from vlpack.data.types import Conversation, EncodedSample, ImageRef, VideoRef
from vlpack.model.build import ModelSpec, folder_has_weights
from vlpack.model.synthetic import default_mix, fit_ids


class CheckUnsupportedError(ValueError):
    """The check cannot run as asked (exit status 2); the message says what to do instead."""


INITS = ("auto", "random")
"""`--init`: auto (a folder's weights; presets have random ones), random (random weights of the
folder's config.json, seeded by `--seed`; no weight file is read)."""


def refuse_init(model_name: str, init: str) -> None:
    """`CheckUnsupportedError` for an unknown `--init`, and for a folder with config.json and no
    weights unless `init="random"`, with a message that names `--init random`. (The check's
    model is built in float32 by train/setup/stack.py's `build_check_model`.)"""
    if init not in INITS:
        raise CheckUnsupportedError(f"--init must be one of {', '.join(INITS)}, got {init!r}")
    path = Path(model_name)
    if (init == "auto" and path.is_dir() and (path / "config.json").is_file()
            and not folder_has_weights(path)):
        raise CheckUnsupportedError(
            f"{path} has config.json but no weights (*.safetensors, or "
            "model.safetensors.index.json with its shards): copy the checkpoint's weight files "
            "into it, or check random weights of its shape with `vlpack check --model "
            f"{path} --init random`")


KINDS = ("text", "image", "video_frames", "video_file")
"""The kinds of sample `--data` covers: text only, images, videos as frame lists, video files."""
SCAN_LIMIT = 100_000
"""Records `--data` reads at most while looking for a sample of each kind."""
MAX_LISTED = 5
"""Skipped records named one by one in the report; the rest are counted."""


def kinds_of(conv: Conversation) -> set[str]:
    """The `KINDS` a conversation holds."""
    out = set()
    for m in conv.messages:
        for c in m.content:
            if isinstance(c, ImageRef):
                out.add("image")
            elif isinstance(c, VideoRef):
                out.add("video_file" if c.path is not None else "video_frames")
    return out or {"text"}


def load_samples(spec: ModelSpec, *, samples: int, seed: int, data: DataFile | None,
                 model_name: str | None = None, replica: int = 0,
                 model: nn.Module | None = None,
                 ) -> tuple[list[EncodedSample], str, dict]:
    """The check's samples, a description of their source, and what the report says of the
    data (`data_kinds`, `data_skipped`, and `encoding`: `encoding.compare_encoding` of
    the folder `model_name`, or of the preset, when `model` is given).

    `samples` to take and the `seed`; `data`: a JSONL file with its media root, the path
    "synth" (the built-in synthetic receipts) or None for the synthetic mix; `model_name`: a
    folder whose tokenizer and chat template encode the data, as `vlpack train` uses them;
    `replica`: a data-parallel replica's index, whose row holds the samples rotated by it, so
    that no two replicas pack the same row."""
    n = int(samples)
    if n < 2:
        raise CheckUnsupportedError("--samples must be >= 2: the check packs several samples "
                                    "into one row and proves they stay apart")
    if not data:
        rows = default_mix(spec, n, seed=seed)
        source, info = "synthetic (multi-image, text-only, padded)", {}
    else:
        rows, source, info = _from_file(data, spec, n, seed=seed, model_name=model_name,
                                        model=model)
    k = int(replica or 0) % len(rows)
    return rows[k:] + rows[:k], source, info


def _encoder(spec: ModelSpec, folder: Path):
    """The check's encoder: the folder's tokenizer and chat template when it has them, small
    images and clips (a CPU check)."""
    from vlpack.config import DataConfig, VideoSettings
    from vlpack.data.encode import Encoder
    from vlpack.data.tokenizer import has_tokenizer
    from vlpack.families import family as family_of

    fam = family_of(spec.family)
    if (spec.patch_size, spec.merge_size) != (fam.patch_size, fam.merge_size):
        raise CheckUnsupportedError(
            f"--data: {spec.name} has vision patch {spec.patch_size} and merge "
            f"{spec.merge_size}, the {spec.family} processor patch {fam.patch_size} and merge "
            f"{fam.merge_size}, so encoded images would not fit it: check it without --data "
            "(synthetic samples of its own shape)")
    factor2 = (spec.patch_size * spec.merge_size) ** 2
    d = DataConfig(max_pixels=64 * factor2,
                   video=VideoSettings(max_frames=8, min_pixels=4 * factor2,
                                       max_pixels=128 * factor2),
                   chat_template="auto" if has_tokenizer(folder) else "builtin")
    return Encoder.from_config(d, spec.family, folder, tokens_per_second=spec.tokens_per_second,
                               folder_processor=False)


def _scan(file: DataFile, n: int, skipped: list[str]) -> list[Conversation]:
    """The good records of `file` in file order, read until one of each kind the file holds
    and `n` records are in hand (or `SCAN_LIMIT`); bad ones met on the way go to `skipped`."""
    from vlpack.data.sources import iter_jsonl
    from vlpack.data.types import BadSampleError

    good, seen = [], set()
    for i, item in enumerate(iter_jsonl(file)):
        if isinstance(item, BadSampleError):
            skipped.append(str(item))
        else:
            good.append(item)
            seen |= kinds_of(item)
        if (len(good) >= n and seen >= set(KINDS)) or i + 1 >= SCAN_LIMIT:
            break
    return good


def _pick(good: list[Conversation], n: int, encode, skipped: list[str],
          ) -> list[tuple[Conversation, EncodedSample]]:
    """Up to `n` records of `good` that encode, in file order: first one of each kind not yet
    covered, then the next records; those that fail to encode go to `skipped`."""
    from vlpack.data.types import BadSampleError

    chosen: dict[int, tuple[Conversation, EncodedSample]] = {}
    tried: set[int] = set()
    covered: set[str] = set()
    for first in (True, False):
        for i, conv in enumerate(good):
            if len(chosen) >= n:
                break
            if i in tried or (first and kinds_of(conv) <= covered):
                continue
            tried.add(i)
            try:
                chosen[i] = (conv, encode(conv))
            except BadSampleError as e:
                skipped.append(str(e))
                continue
            covered |= kinds_of(conv)
    return [chosen[i] for i in sorted(chosen)]


def _from_file(file: DataFile, spec: ModelSpec, n: int, *, seed: int, model_name: str | None,
               model: nn.Module | None):
    folder = Path(model_name or "")
    enc = _encoder(spec, folder)
    if file.path == Path("synth"):
        from vlpack.data.synth import default_dataset

        file = DataFile(default_dataset(max(n, 16), seed=seed), file.media_root)
    path = file.path
    skipped: list[str] = []
    good = _scan(file, n, skipped)
    picked = _pick(good, n, enc.encode, skipped)
    if len(picked) < 2:
        raise CheckUnsupportedError(
            f"{path} holds {len(picked)} usable conversation(s) among the records read; the "
            "check needs at least 2" + (f" (skipped: {'; '.join(skipped[:MAX_LISTED])})"
                                        if skipped else ""))
    vision = dict(image_token_id=enc.image_pad_id, video_token_id=enc.video_pad_id,
                  vision_start_token_id=enc.vision_start_id, vision_end_token_id=enc.vision_end_id)
    samples = [fit_ids(s, spec, vision) for _, s in picked]
    convs = [c for c, _ in picked]
    present = set().union(*(kinds_of(c) for c in good)) if good else set()
    covered = set().union(*(kinds_of(c) for c in convs))
    info: dict = dict(data_kinds={k: sum(k in kinds_of(c) for c in convs) for k in KINDS
                                  if k in covered},
                      data_kinds_left_out=[k for k in KINDS if k in present - covered],
                      data_skipped=skipped)
    if model is not None:
        from vlpack.check.encoding import compare_encoding

        info["encoding"] = compare_encoding(folder if model_name and folder.is_dir() else None,
                                            convs, spec,
                                            model, enc=enc)
    return samples, str(path), info


def format_data(r: dict) -> list[str]:
    """The report's lines on the data file: kinds used, records skipped, the encoding check."""
    lines = []
    if r.get("data_kinds"):
        lines.append("kinds: " + ", ".join(f"{k} {v}" for k, v in r["data_kinds"].items())
                     + ("; not used (raise --samples): " + ", ".join(r["data_kinds_left_out"])
                        if r.get("data_kinds_left_out") else ""))
    skipped = r.get("data_skipped") or []
    if skipped:
        lines.append(f"skipped {len(skipped)} bad record(s): " + "; ".join(skipped[:MAX_LISTED])
                     + (f"; {len(skipped) - MAX_LISTED} more" if len(skipped) > MAX_LISTED
                        else ""))
    e = r.get("encoding")
    if e is not None:
        if e["skipped"]:
            lines.append(f"encoding vs transformers: not compared: {e['skipped']}")
        else:
            lines.append(f"encoding vs transformers: {len(e['compared'])} sample(s) compared, "
                         f"{len(e['failures'])} difference(s)")
        lines += [f"  partly compared: {k}: {why}" for k, why in e.get("partly", {}).items()]
        lines += [f"  not compared: {k}: {why}" for k, why in e["not_compared"].items()]
    return lines
