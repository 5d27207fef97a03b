"""train/stack.py: `vlpack check` builds through the trainer's build stage."""

from __future__ import annotations

import torch

from vlpack.config import Config, ModelConfig, TrainConfig
from vlpack.train.check import check_config
from vlpack.train.parallel import Topology
from vlpack.train.stack import build_check_model, build_stack


def test_check_builds_the_model_the_trainer_trains(tmp_path):
    """The check's model (its flags as a config, float32) holds bit for bit the weights
    `build_stack` gives `vlpack train` with the same name, seed and backend, on the same
    attention backend and seam classes."""
    cpu = torch.device("cpu")
    model, spec = build_check_model(check_config("tiny-qwen2_vl", seed=3), cpu)
    cfg = Config(model=ModelConfig(name="tiny-qwen2_vl", dtype="float32"),
                 train=TrainConfig(seed=3, output_dir=str(tmp_path)))
    stack = build_stack(cfg, Topology(rank=0, world_size=1, local_rank=0, device=cpu))
    trained = stack.model
    assert spec == stack.spec
    theirs = trained.state_dict()
    assert model.state_dict().keys() == theirs.keys()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())
    assert [type(m) for m in model.modules()] == [type(m) for m in trained.modules()]
