"""train.epochs: the steps computed from the planned bins cover every sample of that many passes,
and one step fewer does not."""

from __future__ import annotations

import math

import pytest

from vlpack.config import DataConfig, VideoSettings, load_config
from vlpack.data.encode import Encoder
from vlpack.data.loader import PackedLoader, open_dataset
from vlpack.train.epochs import steps_for_epochs


@pytest.fixture(scope="module")
def loader_args():
    enc = Encoder("qwen3_vl", min_pixels=16384, max_pixels=50176,
                  video=VideoSettings(min_pixels=4096, max_pixels=50176))
    return open_dataset("synthetic", None, synthetic_samples=24), enc


def _consumed(loader: PackedLoader, batches: int) -> list[int]:
    """Samples of each epoch the training loader has handed out after `batches` batches."""
    loader.load_state_dict({"consumed": 0})
    it = iter(loader)
    for _ in range(batches):
        next(it)
    per_epoch = loader.accounting["epochs"]
    return [per_epoch[e]["samples"] if e in per_epoch else 0 for e in range(max(per_epoch) + 1)]


@pytest.mark.parametrize(("micro_batches", "epochs"), [(1, 1), (3, 2)])
def test_steps_cover_every_sample_of_the_epochs(loader_args, micro_batches: int, epochs: int) -> None:
    items, enc = loader_args
    loader = PackedLoader(items, enc, DataConfig(seq_len=1024, buffer_size=8, pad_to_multiple_of=1),
                          seed=0, epochs=None, pad_token_id=0, per_round=micro_batches)
    steps, bins = steps_for_epochs(loader, epochs, dp=1, micro_batches=micro_batches)
    assert steps == math.ceil(bins / micro_batches)
    done = _consumed(loader, steps * micro_batches)
    assert done[:epochs] == [24] * epochs, done
    short = _consumed(loader, bins - 1)  # the bin before holds not yet every sample
    assert short[:epochs] != [24] * epochs, short
    assert steps_for_epochs(loader, epochs, dp=2, micro_batches=micro_batches)[0] == math.ceil(
        bins / (2 * micro_batches))


def test_a_stream_of_unknown_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"train.epochs needs the dataset's size .*set train.max_steps"):
        steps_for_epochs(object(), 1, dp=1, micro_batches=1)


def test_epochs_with_a_token_budget_is_refused() -> None:
    with pytest.raises(ValueError, match=r"train.epochs counts steps of train.micro_batches bins"):
        load_config("tiny", ["train.epochs=2", "train.tokens_per_step=4096"])


def test_the_trainer_runs_the_steps_of_its_epochs(tmp_path) -> None:
    from tests.helpers import CPU, small_cfg
    from vlpack.train.trainer import Trainer

    t = Trainer(small_cfg(tmp_path, "train.epochs=2", "train.micro_batches=2", "data.seq_len=1024"), CPU)
    steps, _ = steps_for_epochs(t.train_loader, 2, dp=1, micro_batches=2)
    assert t.cfg.train.max_steps == steps and steps < 40  # not the recipe's max_steps
    assert t.scheduler.lr_lambdas[0](steps) == pytest.approx(t.cfg.optim.min_lr_ratio)  # decayed at its end
    assert t.scheduler.lr_lambdas[0](steps - 2) > t.cfg.optim.min_lr_ratio


def test_an_epochs_run_resumes_exactly(tmp_path) -> None:
    """train.epochs: stopped after 2 steps and resumed, the run trains the same steps with the
    same losses as straight through (the step count is recomputed alike on resume)."""
    from tests.helpers import CPU, losses, small_cfg
    from vlpack.train.trainer import Trainer

    args = ("train.epochs=1", "data.seq_len=1024")
    straight = Trainer(small_cfg(tmp_path / "a", *args), CPU)
    straight.fit()
    stopped = Trainer(small_cfg(tmp_path / "b", *args, "train.stop_after=2"), CPU)
    stopped.fit()
    assert stopped.step == 2 < straight.step
    resumed = Trainer(small_cfg(tmp_path / "b", *args, "train.resume=auto"), CPU)
    assert resumed.cfg.train.max_steps == straight.cfg.train.max_steps
    resumed.fit()
    assert resumed.step == straight.step
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
