"""train/setup/stack.py: `vlpack check` builds through the trainer's build stage."""

from __future__ import annotations

from pathlib import Path

import torch

from vlpack.check.command import check_config
from vlpack.config import Config, ModelConfig, TrainConfig
from vlpack.train.distributed.parallel import Topology
from vlpack.train.setup.stack import build_check_model, build_stack


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


def test_int8_reads_a_folder_into_host_memory_and_draws_random_weights_on_the_device(
        tmp_path: Path) -> None:
    """`model.frozen_dtype=int8` on a GPU: a folder's weights are read into host memory (the
    GPU never holds the bf16 experts); random weights are drawn on the GPU as every run draws
    them (resume and export draw the same ones). On CPU the host is the device."""
    from tests.helpers import hf_test_folder
    from vlpack.config import load_config
    from vlpack.train.setup.prepare import builds_on_host

    folder = tmp_path / "moe"
    hf_test_folder(folder, "qwen3_5_moe")
    gpu = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    cpu = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    def cfg(*keys):
        return load_config("tiny", ["model.lora.rank=4", *keys])

    assert builds_on_host(cfg(f"model.name={folder}", "model.frozen_dtype=int8"), gpu)
    assert not builds_on_host(cfg(f"model.name={folder}", "model.frozen_dtype=int8"), cpu)
    assert not builds_on_host(cfg(f"model.name={folder}", "model.frozen_dtype=int8",
                                  "model.init=random"), gpu)
    assert not builds_on_host(cfg("model.name=tiny-qwen3_5_moe", "model.frozen_dtype=int8"), gpu)
    assert not builds_on_host(cfg(f"model.name={folder}"), gpu)
