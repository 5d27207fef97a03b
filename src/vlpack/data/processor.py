"""Image processing settings of a family and of a checkpoint folder: transformers' PIL Qwen2-VL
image processor with the family's patch, merge and temporal sizes and pixel budget
(`vlpack.families`), and the folder's `preprocessor_config.json` /
`video_preprocessor_config.json` read and checked against the family's model.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlpack.families import family as family_of

if TYPE_CHECKING:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )


@functools.lru_cache(maxsize=16)
@dataclass(frozen=True)
class FolderProcessor:
    """The image settings of a checkpoint folder's `preprocessor_config.json`."""

    file: str
    min_pixels: int | None
    max_pixels: int | None
    image_mean: tuple[float, ...] | None
    image_std: tuple[float, ...] | None


def read_processor_config(path: Path, family: str) -> dict | None:
    """A checkpoint folder's processor settings file (`preprocessor_config.json`,
    `video_preprocessor_config.json`) as a dict, None when absent; a ValueError naming the file
    when it cannot be read or its patch, merge or temporal size differs from the family's model
    (a processor of another model)."""
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e}); fix the file or remove it to use "
                         f"the {family} defaults") from None
    spec = family_of(family)
    for key, want in (("patch_size", spec.patch_size), ("merge_size", spec.merge_size),
                      ("temporal_patch_size", spec.temporal_patch_size)):
        if cfg.get(key) is not None and int(cfg[key]) != want:
            raise ValueError(f"{path}: {key}={cfg[key]} but the {family} model takes {want}: "
                             "this processor belongs to another model")
    return cfg


def folder_processor(folder: str | Path, family: str) -> FolderProcessor | None:
    """The image settings a HF checkpoint folder saved (None when it has no
    `preprocessor_config.json`); a ValueError naming the file when its patch, merge or temporal
    size differs from the family's model (a processor of another model)."""
    path = Path(folder) / "preprocessor_config.json"
    cfg = read_processor_config(path, family)
    if cfg is None:
        return None
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels", size.get("min_pixels", size.get("shortest_edge")))
    hi = cfg.get("max_pixels", size.get("max_pixels", size.get("longest_edge")))

    def triple(key):
        v = cfg.get(key)
        return None if v is None else tuple(float(x) for x in v)

    return FolderProcessor(str(path), None if lo is None else int(lo),
                           None if hi is None else int(hi), triple("image_mean"),
                           triple("image_std"))


def load_image_processor(
    family: str, min_pixels: int | None = None, max_pixels: int | None = None,
    image_mean: tuple[float, ...] | None = None, image_std: tuple[float, ...] | None = None,
) -> Qwen2VLImageProcessorPil:
    """transformers' PIL Qwen2-VL image processor (no torchvision) with the family's patch size;
    `min_pixels`/`max_pixels` and the normalisation default to the family's
    (`vlpack.families`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    spec = family_of(family)
    norm = {} if spec.image_norm is None else {"image_mean": [spec.image_norm] * 3,
                                               "image_std": [spec.image_norm] * 3}
    if image_mean is not None and image_std is not None:
        norm = {"image_mean": list(image_mean), "image_std": list(image_std)}
    return Qwen2VLImageProcessorPil(
        **norm,
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        min_pixels=spec.min_pixels if min_pixels is None else min_pixels,
        max_pixels=spec.max_pixels if max_pixels is None else max_pixels,
    )
