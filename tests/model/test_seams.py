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


def test_a_model_pickled_whole_loads_in_a_fresh_process(tmp_path):
    """`torch.save(model)` of a LoRA run's hybrid MoE model loads in a process that has built
    no model (its seam and adapter classes are made on lookup) and gives the same packed loss."""
    import subprocess
    import sys

    import torch

    from vlpack.config import LoraConfig
    from vlpack.data.batch import build_thd_batch
    from vlpack.model import lora
    from vlpack.model.forward import packed_forward
    from vlpack.model.synthetic import default_mix

    model, spec = build_model("tiny-qwen3_5_moe", device="cpu", seed=0)
    lora.apply_lora(model, LoraConfig(rank=4, alpha=8))
    batch = build_thd_batch(default_mix(spec, 3, seed=0), pad_token_id=spec.pad_token_id,
                            pad_to_multiple_of=8, mrope_after_video="transformers")
    with torch.no_grad():
        want = float(packed_forward(model, batch, spec=spec).loss_sum)
    torch.save((model, spec, batch), tmp_path / "whole.pt")
    code = ("import sys, torch; from vlpack.model.forward import packed_forward; "
            "model, spec, batch = torch.load(sys.argv[1], weights_only=False); "
            "print(repr(float(packed_forward(model, batch, spec=spec).loss_sum.detach())))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "whole.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.strip().splitlines()[-1]) == want
