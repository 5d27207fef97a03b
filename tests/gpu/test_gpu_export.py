"""GPU test (skipped without CUDA): the export of a one-GPU LoRA run on a preset, whose frozen
base was drawn on the GPU in bf16 (random weights a checkpoint does not hold)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import small_cfg
from vlpack.train.distributed.parallel import Topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_export_draws_a_gpu_drawn_base_again_on_the_gpu(tmp_path: Path) -> None:
    """`vlpack export` of the run's checkpoint rebuilds the bf16 base on the GPU: the merged
    float32 export equals the trained model's merged weights bit for bit."""
    pytest.importorskip("peft")
    from vlpack.model import lora
    from vlpack.train.run import checkpoint as ckpt
    from vlpack.train.run.export import export_checkpoint
    from vlpack.train.trainer import Trainer

    gpu = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    t = Trainer(small_cfg(tmp_path / "run", "train.max_steps=2", "model.lora.rank=4",
                          "model.lora.alpha=8", "optim.lr=1e-2"), gpu)
    t.fit()
    assert ckpt.marker(ckpt.latest_checkpoint(tmp_path / "run"))["device"] == "cuda"
    folder = export_checkpoint(tmp_path / "run", tmp_path / "hf", out_dtype="float32")
    got = {k: v for p in folder.glob("*.safetensors") for k, v in load_file(p).items()}
    want = lora.merged_state_dict(t.model, {k: v.detach().cpu()
                                            for k, v in t.model.state_dict().items()})
    want.pop("lm_head.weight")  # tied to the embedding
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.float()), k
