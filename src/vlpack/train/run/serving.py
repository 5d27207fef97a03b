"""The files an exported folder needs besides its weights and config for a serving engine:
tokenizer, chat template, `preprocessor_config.json`, `video_preprocessor_config.json` and
`generation_config.json`.

A run trained from a checkpoint folder exports that folder's own files (its tokenizer from
`data.tokenizer` when set); a run on a preset, the family's: vlpack's built-in tokenizer, the
family's chat template (data/chat_templates.py, the Jinja form of the built-in rendering), the
image and video settings the run encoded with, and a generation config that stops at
`<|im_end|>` and `<|endoftext|>`. Either way the chat template is the one the run rendered its
samples with, and the image processor holds the run's pixel bounds (`data.min_pixels`,
`data.max_pixels` override the folder's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vlpack.config import Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
FOLDER_FILES = ("preprocessor_config.json", "video_preprocessor_config.json",
                "generation_config.json", "processor_config.json", "chat_template.jinja",
                "chat_template.json")
VIDEO_PROCESSOR = {"qwen2": "Qwen2VLVideoProcessor", "qwen3": "Qwen3VLVideoProcessor"}


def _copy(names: tuple[str, ...], src: Path, out: Path) -> list[str]:
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    return copied


def write_serving_files(out: Path, cfg: Config, family: str) -> None:
    """Write the tokenizer, chat template, processor settings and generation config of run
    `cfg` (model family `family`) into the exported folder `out` (module docstring)."""
    from vlpack.data.chat_templates import family_template
    from vlpack.data.template import load_template
    from vlpack.data.tokenizer import has_tokenizer, load_tokenizer

    folder = Path(cfg.model.name)
    folder = folder if folder.is_dir() else None
    tok_dir = cfg.data.tokenizer or (str(folder) if folder and has_tokenizer(folder) else None)
    if folder is not None:
        _copy(FOLDER_FILES, folder, out)
    if tok_dir is not None:
        _copy(TOKENIZER_FILES, Path(tok_dir), out)
    else:
        load_tokenizer(family).save_pretrained(out)
    template = load_template(cfg.data.chat_template, folder)
    (out / "chat_template.json").unlink(missing_ok=True)  # one template: the run's
    (out / "chat_template.jinja").write_text(
        template.source if template is not None else family_template(family))
    _write_image_settings(out, cfg, family, copied=folder is not None)
    if not (out / "video_preprocessor_config.json").is_file():
        _write_video_settings(out, cfg, family)
    if not (out / "generation_config.json").is_file():
        _write_generation_config(out, family)


def _write_image_settings(out: Path, cfg: Config, family: str, *, copied: bool) -> None:
    """`preprocessor_config.json`: the folder's with the run's pixel bounds, else the family's
    image processor with them."""
    from vlpack.data.processor import load_image_processor

    lo, hi = cfg.data.min_pixels, cfg.data.max_pixels
    path = out / "preprocessor_config.json"
    if copied and path.is_file():
        settings = json.loads(path.read_text())
        for key, value in (("min_pixels", lo), ("max_pixels", hi)):
            if value is not None:
                settings[key] = value
                edge = "shortest_edge" if key == "min_pixels" else "longest_edge"
                settings.setdefault("size", {})[edge] = value
        path.write_text(json.dumps(settings, indent=2) + "\n")
        return
    load_image_processor(family, lo, hi).save_pretrained(out)


def _write_video_settings(out: Path, cfg: Config, family: str) -> None:
    """`video_preprocessor_config.json` of the family's video processor with the settings the
    run sampled and sized videos with (data.video over the family's defaults)."""
    from vlpack.data import video as vid
    from vlpack.families import family as family_of

    spec, rules = family_of(family), vid.rules(family)
    settings = cfg.data.video.over(vid.DEFAULTS)
    lo = rules.min_pixels if settings.min_pixels is None else settings.min_pixels
    hi = rules.max_pixels if settings.max_pixels is None else settings.max_pixels
    norm = spec.image_norm
    mean, std = ([norm] * 3, [norm] * 3) if norm is not None else (
        [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    body = {
        "video_processor_type": VIDEO_PROCESSOR[rules.style],
        "processor_class": PROCESSOR_MAPPING_NAMES[family_of(family).name],
        "patch_size": rules.patch, "merge_size": rules.merge,
        "temporal_patch_size": rules.temporal, "image_mean": mean, "image_std": std,
        "size": {"shortest_edge": lo, "longest_edge": hi},
        "fps": settings.fps, "min_frames": settings.min_frames, "max_frames": settings.max_frames,
        "do_sample_frames": rules.style == "qwen3",
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(body, indent=2) + "\n")


def _write_generation_config(out: Path, family: str) -> None:
    """`generation_config.json` that ends generation at `<|im_end|>` or `<|endoftext|>`."""
    from transformers import GenerationConfig

    from vlpack.families import family as family_of

    ids = family_of(family).ids
    GenerationConfig(eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]],
                     pad_token_id=ids["pad_token_id"]).save_pretrained(out)
