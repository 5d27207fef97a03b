"""Synthetic samples with real token ids (model/synthetic.py), as `vlpack check` packs them."""

from __future__ import annotations

import numpy as np

from vlpack.model import build_model
from vlpack.model.synthetic import default_mix


def test_check_samples_are_valid_for_the_batch_builder():
    _model, spec = build_model("tiny-qwen3_5", device="cpu")
    for s in default_mix(spec, 8, seed=5):
        assert s.pixel_values is None or s.pixel_values.shape[1] == spec.patch_dim
        assert np.all(s.labels[s.mm_token_type_ids != 0] == -100)


def test_synthetic_text_ids_fit_a_small_vocabulary():
    from vlpack.model.build import build_model
    from vlpack.model.synthetic import default_mix, text_id_range

    _, spec = build_model("tiny-qwen3_vl", device="meta")
    assert text_id_range(spec) == (0, 151643)  # below <|endoftext|>, the first special id
    small = spec.__class__(**{**spec.__dict__, "vocab_size": 99, "pad_token_id": 2,
                              "eos_token_id": 1, "image_token_id": 3, "video_token_id": 4,
                              "vision_start_token_id": 5, "vision_end_token_id": 6})
    assert text_id_range(small) == (7, 99)
    for s in default_mix(small, 4):
        text = s.input_ids[s.mm_token_type_ids == 0]
        assert set(text.tolist()) - set(range(7, 99)) <= {1, 5, 6}  # eos, vision start/end
