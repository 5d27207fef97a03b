"""`vlpack train data.source=energon`: the same first bins and first-step loss as the JSONL path
on the same samples, planner and seed; resume continues the Energon stream exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import SMALL, losses
from vlpack.config import load_config
from vlpack.data.energon.prepare import prepare_energon
from vlpack.data.synth import default_dataset
from vlpack.train.loop import Trainer
from vlpack.train.parallel import Topology

CPU = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
N = 12


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    src = default_dataset(n=N)
    out = tmp_path_factory.mktemp("energon-train") / "ds"
    prepare_energon(src, out, shard_size=5)
    return src, out


def cfg(out: Path, *extra: str):
    return load_config("tiny", [*SMALL, f"train.output_dir={out}", "data.shuffle=false",
                                   "model.init=random", *extra])


def test_first_bins_and_first_step_loss_equal_the_jsonl_path(data, tmp_path: Path) -> None:
    """No shuffle and one planning round over the N samples on both paths: the JSONL planner's
    buffer is larger than the dataset (its first round is the flush at the epoch boundary),
    Energon's buffer is the dataset. See docs/energon.md for when the paths differ."""
    src, ds = data
    jsonl = Trainer(cfg(tmp_path / "j", "data.source=jsonl", f"data.path={src}",
                        f"data.buffer_size={N + 1}", "train.max_steps=2"), CPU)  # fmt: skip
    energon = Trainer(cfg(tmp_path / "e", "data.source=energon", f"data.path={ds}",
                          f"data.packing_buffer_size={N}", "train.max_steps=2"), CPU)  # fmt: skip
    first = [next(iter(t.train_loader)) for t in (jsonl, energon)]
    assert first[0].sample_keys == first[1].sample_keys
    assert torch.equal(first[0].input_ids, first[1].input_ids)
    jsonl.train_loader.load_state_dict({"consumed": 0})  # rewind both streams
    energon.train_loader.close()
    sj, se = jsonl.fit(), energon.fit()
    assert se["first_loss"] == pytest.approx(sj["first_loss"], abs=1e-6)
    assert losses(tmp_path / "e") == pytest.approx(losses(tmp_path / "j"), abs=1e-5)


def test_energon_training_resumes_exactly(data, tmp_path: Path) -> None:
    _, ds = data
    args = ("data.source=energon", f"data.path={ds}", "data.packing_buffer_size=6",
            "data.num_workers=2", "train.max_steps=4")  # fmt: skip
    Trainer(cfg(tmp_path / "a", *args), CPU).fit()
    Trainer(cfg(tmp_path / "b", *args[:-1], "train.max_steps=2"), CPU).fit()
    resumed = Trainer(cfg(tmp_path / "b", *args), CPU)
    summary = resumed.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert summary["skipped"] == {} and summary["steps"] == 4
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


def test_vlpack_train_command_runs_on_an_energon_dataset(data, tmp_path: Path, capsys) -> None:
    from vlpack.cli import main

    _, ds = data
    assert main(["train", *SMALL, "data.source=energon", f"data.path={ds}", "train.max_steps=1",
                 "model.init=random",
                 f"train.output_dir={tmp_path}"]) == 0  # fmt: skip
    assert "vlpack: done" in capsys.readouterr().out
    assert len(losses(tmp_path)) == 1
