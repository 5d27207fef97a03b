"""Where vlpack plugs into transformers (model/seams.py): seam classes installed by class."""

from __future__ import annotations

import copy
import pickle

from vlpack.model import build_model


def test_seams_are_installed_by_class_and_survive_copy_and_pickle():
    """Each family's seam classes become vlpack's subclasses (the config untouched); a deep
    copy and a pickled model keep them, and a second install changes nothing."""
    from vlpack.model import seams

    model, _ = build_model("tiny-qwen3_vl", device="cpu")
    kinds = {type(m).__name__ for m in model.modules() if type(m).__module__ == seams.__name__}
    assert kinds == {"PackedQwen3VLVisionAttention", "PackedQwen3VLVisionModel",
                     "PackedQwen3VLTextModel", "PackedQwen3VLModel"}
    assert "vlpack" not in model.config.to_json_string()
    assert seams.install(model, "qwen3_vl") == {"vision_attention": 2, "vision_tower": 1,
                                                "image_features": 1, "deepstack": 1}
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert {type(m).__name__ for m in twin.modules()} >= kinds
