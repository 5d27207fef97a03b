"""The run's encoder, built from the config's `data` section and the model it feeds."""

from __future__ import annotations

import logging
from pathlib import Path

from vlpack.config import DataConfig
from vlpack.data.encode import Encoder
from vlpack.data.tokenizer import has_tokenizer

log = logging.getLogger("vlpack.data")


def build_encoder(d: DataConfig, spec, model_name: str, *, announce: bool = False) -> Encoder:
    """The Encoder of `data.*` for the model `model_name` (`spec`: its ModelSpec). The
    tokenizer, chat template and image/video settings come from `data.tokenizer`, else the
    model's folder, else the family's built-ins; `announce` logs where each came from."""
    folder = Path(model_name)
    if d.tokenizer is None and not has_tokenizer(folder) and folder.is_dir() and announce:
        log.warning("%s has no tokenizer files (tokenizer.json / vocab.json): vlpack's built-in "
                    "%s tokenizer encodes the data; copy the checkpoint's tokenizer files into "
                    "the folder, or set data.tokenizer=FOLDER", folder, spec.family)
    enc = Encoder.from_config(d, spec.family, model_name,
                              tokens_per_second=spec.tokens_per_second)
    if announce:
        if enc.chat_template:
            log.info("chat template from %s", enc.chat_template.file)
        if enc.video_file:
            log.info("video settings from %s: %s", enc.video_file, enc.video)
        if enc.processor_file:
            log.info("image settings from %s: %d-%d pixels per image", enc.processor_file,
                     enc.min_pixels, enc.max_pixels)
    if enc.image_pad_id != spec.image_token_id:
        raise ValueError(
            f"tokenizer image_pad id {enc.image_pad_id} != model image_token_id "
            f"{spec.image_token_id}: use the tokenizer that belongs to {model_name} "
            "(data.tokenizer=FOLDER)")
    return enc

