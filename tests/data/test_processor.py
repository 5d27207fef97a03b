"""The image processor of a family (`vlpack.data.processor`): patch sizes and the default pixel
budget."""

from __future__ import annotations

import numpy as np
from PIL import Image

from vlpack.data.processor import load_image_processor
from vlpack.families import family as family_of


def test_image_processor_patch_sizes():
    image = Image.new("RGB", (100, 150))  # width 100, height 150
    out = load_image_processor("qwen2_vl", min_pixels=56 * 56)(images=[image])
    assert out["image_grid_thw"].tolist() == [[1, 10, 8]]  # FACTS: 100×150 → 8×10 patches
    assert np.asarray(out["pixel_values"]).shape == (80, 3 * 2 * 14 * 14)
    out = load_image_processor("qwen3_vl")(images=[image])
    assert np.asarray(out["pixel_values"]).shape[1] == 3 * 2 * 16 * 16


def test_default_pixels():
    # The documented budget: a 1000×1600 receipt keeps full size, ~2,000 tokens at patch 14.
    for family, tokens in [("qwen2_vl", 1995), ("qwen3_vl", 1550)]:
        spec = family_of(family)
        assert spec.max_pixels == 2048 * spec.factor**2
        assert spec.min_pixels == 64 * spec.factor**2
        out = load_image_processor(family)(images=[Image.new("RGB", (1000, 1600))])
        merged = int(np.prod(out["image_grid_thw"][0])) // 4
        assert merged == tokens
