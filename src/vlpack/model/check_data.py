"""The samples `vlpack check` packs: the synthetic mix, or the user's `--data` file encoded as
training encodes it, with ids the checked model can read."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from vlpack.data.types import EncodedSample
from vlpack.model.build import ModelSpec, build_model, folder_has_weights
from vlpack.model.synthetic import default_mix, fit_ids


class CheckUnsupportedError(ValueError):
    """The check cannot run as asked (exit status 2); the message says what to do instead."""


INITS = ("auto", "random")
"""`--init`: auto (a folder's weights; presets have random ones), random (random weights of the
folder's config.json, seeded by `--seed`; no weight file is read)."""


def checked_model(model_name: str, *, init: str = "auto", backend: str = "auto",
                  device: torch.device | str | None = None,
                  seed: int = 0) -> tuple[nn.Module, ModelSpec]:
    """The model the check runs on, in float32 (the contract's dtype; a bf16 check casts the
    same weights after). A folder with config.json and no weights is refused unless
    `init="random"`, with a message that names `--init random`."""
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
    return build_model(model_name, backend=backend, dtype=torch.float32, device=device,
                       seed=seed, random_init=init == "random")


def load_samples(args: argparse.Namespace, spec: ModelSpec) -> tuple[list[EncodedSample], str]:
    """The check's samples and a description of their source (`args.samples`, `args.seed`,
    `args.data`: a JSONL file, "synth" or None for the synthetic mix; `args.model`: a folder
    whose tokenizer and chat template encode the data, as `vlpack train` uses them;
    `args.replica`: a data-parallel replica's index, whose row holds the samples rotated by it,
    so that no two replicas pack the same row)."""
    samples, source = _samples(args, spec)
    k = int(getattr(args, "replica", 0) or 0) % len(samples)
    return samples[k:] + samples[:k], source


def _samples(args: argparse.Namespace, spec: ModelSpec) -> tuple[list[EncodedSample], str]:
    n = int(args.samples)
    if n < 2:
        raise CheckUnsupportedError("--samples must be >= 2: the check packs several samples "
                                    "into one row and proves they stay apart")
    if not args.data:
        return default_mix(spec, n, seed=args.seed), "synthetic (multi-image, text-only, padded)"
    from vlpack.data.encode import Encoder
    from vlpack.data.sources import read_jsonl
    from vlpack.data.template import load_template
    from vlpack.data.tokenizer import family_spec, has_tokenizer
    from vlpack.data.video import VideoSettings

    fam = family_spec(spec.family)
    if (spec.patch_size, spec.merge_size) != (fam.patch_size, fam.merge_size):
        raise CheckUnsupportedError(
            f"--data: {spec.name} has vision patch {spec.patch_size} and merge "
            f"{spec.merge_size}, the {spec.family} processor patch {fam.patch_size} and merge "
            f"{fam.merge_size}, so encoded images would not fit it: check it without --data "
            "(synthetic samples of its own shape)")
    path = args.data
    if path == "synth":
        from vlpack.data.synth import default_dataset

        path = default_dataset(max(n, 16), seed=args.seed)
    convs = read_jsonl(Path(path))[:n]
    if len(convs) < 2:
        raise CheckUnsupportedError(f"{path} holds {len(convs)} usable conversation(s); the "
                                    "check needs at least 2")
    folder = Path(getattr(args, "model", "") or "")
    own = has_tokenizer(folder)
    factor2 = (spec.patch_size * spec.merge_size) ** 2  # small images and clips: a CPU check
    enc = Encoder(spec.family, max_pixels=64 * factor2,
                  video=VideoSettings(max_frames=8, min_pixels=4 * factor2,
                                      max_pixels=128 * factor2),
                  tokens_per_second=spec.tokens_per_second,
                  tokenizer_path=str(folder) if own else None,
                  chat_template=load_template("auto", folder) if own else None)
    vision = dict(image_token_id=enc.image_pad_id, video_token_id=enc.video_pad_id,
                  vision_start_token_id=enc.vision_start_id, vision_end_token_id=enc.vision_end_id)
    return [fit_ids(enc.encode(c), spec, vision) for c in convs], str(path)
