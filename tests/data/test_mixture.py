"""Weighted mixtures (data/mixture.py): counts worked out by hand, proportions in the stream
within a binomial bound, per-source counts, and resume ≡ uninterrupted."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.data.test_loader import dataset, loader, same
from tests.helpers import CPU, small_cfg
from vlpack.config import load_config
from vlpack.data.mixture import Mixture, mixture_counts, mixture_index
from vlpack.data.stream import BinStream
from vlpack.train.run.metrics import format_summary
from vlpack.train.trainer import Trainer


@pytest.mark.parametrize("sizes, weights, counts", [
    ([3, 1], [1, 1], [2, 2]),            # N = 4, half each
    ([30, 10], [1, 3], [10, 30]),        # N = 40: a quarter and three quarters
    ([2, 2, 3], [1, 1, 1], [3, 2, 2]),   # 7/3 each: the one spare sample to the first source
    ([5, 5], [2, 1], [7, 3]),            # 6.67 and 3.33
])  # fmt: skip
def test_counts_by_hand(sizes, weights, counts) -> None:
    assert mixture_counts(sizes, weights) == counts


def test_index_draws_by_count_and_seed() -> None:
    index = mixture_index([30, 10], [1, 3], seed=5)
    by_source = Counter(index[:, 0].tolist())
    assert by_source == {0: 10, 1: 30}
    small = Counter(index[index[:, 0] == 1, 1].tolist())  # 30 draws of 10 rows: each 3 times
    assert small == {r: 3 for r in range(10)}
    big = index[index[:, 0] == 0, 1]  # 10 distinct rows of 30
    assert len(set(big.tolist())) == 10 and big.max() < 30
    assert np.array_equal(index, mixture_index([30, 10], [1, 3], seed=5))
    assert not np.array_equal(index, mixture_index([30, 10], [1, 3], seed=6))


def _mix(seed: int = 5) -> Mixture:
    return Mixture([dataset(30, seed=1), dataset(10, seed=2)], ["big", "small"], [1, 3], seed)


def test_stream_proportions_and_per_source_counts() -> None:
    mix = _mix()
    run = loader(mix, seq_len=1024, epochs=2)
    batches = list(run)
    assert run.accounting["sources"] == {"big": 20, "small": 60}  # 2 epochs × (10, 30)
    assert run.accounting["packed"] == 80 and sum(len(b.sample_keys) for b in batches) == 80


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_stream_prefix_follows_the_weights(shuffle: bool) -> None:
    """The first 100 samples planned of a 400-sample mixture: each is from the weight-3 source
    with probability 3/4 (drawn without replacement, so the spread is at most the binomial
    one): within 4 standard deviations. Unshuffled, the mixture's own interleaving does it."""
    mix = Mixture([dataset(300, seed=1), dataset(100, seed=2)], ["big", "small"], [1, 3], 7)
    run = loader(mix, seq_len=1024, epochs=1, shuffle=shuffle)
    n = 100
    drawn = [mix.source_name(i) for b in BinStream(sizes=run.sizes, **run.stream_kw)
             for i in b.items][:n]
    k = drawn.count("small")
    assert abs(k - 0.75 * n) <= 4 * math.sqrt(n * 0.75 * 0.25), (k, n)


def test_resume_equals_uninterrupted() -> None:
    mix = _mix()
    straight_run = loader(mix, seq_len=256, epochs=None)
    straight = list(itertools.islice(iter(straight_run), 24))  # > 1 epoch of the mixture
    first = loader(mix, seq_len=256, epochs=None)
    it = iter(first)
    for _ in range(9):
        next(it)
    resumed = loader(_mix(), seq_len=256, epochs=None)  # rebuilt from the same seed
    resumed.load_state_dict(first.state_dict())
    rest = list(itertools.islice(iter(resumed), 15))
    assert all(same(a, b) for a, b in zip(straight[9:], rest, strict=True))
    assert resumed.accounting["sources"] == straight_run.accounting["sources"]


def test_config_reads_a_mix() -> None:
    cfg = load_config(None, ["data.mix=[{path: a.jsonl, weight: 3}, {path: hf_dir, name: web}]",
                             "model.init=random"])
    (a, b) = cfg.data.mix
    assert (a.source, a.weight, a.name, b.source, b.weight, b.name) == \
        ("jsonl", 3.0, "a.jsonl", "hf", 1.0, "web")
    for bad, match in (("data.mix=[{path: a.jsonl, weight: 0}]", "must be > 0"),
                       ("data.mix=[]", "empty list"),
                       ("data.mix=[{path: a.jsonl, weigth: 1}]", "did you mean data.mix.weight"),
                       ("data.mix=[{path: a.jsonl}]\ndata.path=b.jsonl", "drop data.path")):
        with pytest.raises(ValueError, match=match):
            load_config(None, bad.split("\n"))


def test_a_preset_on_mixed_user_data_is_refused() -> None:
    """As with data.source=jsonl: random weights on your data only when asked for."""
    with pytest.raises(ValueError, match=r"data.source=hf \(in data.mix\) is your data"):
        load_config("qwen3-vl-2b", ["data.mix=[{source: synthetic}, {path: d, weight: 2}]"])
    assert load_config("qwen3-vl-2b", ["data.mix=[{source: synthetic}]"]).data.mix


# --- a training run over a mixture -------------------------------------------------------------------
# A training run over a mixture (data.mix) reports what it trained from each source.
def test_run_reports_samples_per_source(tmp_path: Path) -> None:
    cfg = small_cfg(tmp_path, "train.max_steps=2", "train.log_every=1",
                    "data.mix=[{source: synthetic, weight: 3, name: receipts}, "
                    "{source: synthetic, weight: 1, name: more}]")
    trainer = Trainer(cfg, CPU)
    summary = trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "sources" in r][-1]
    assert summary["sources"] == last["sources"]
    assert summary["sources"] and set(summary["sources"]) <= {"receipts", "more"}
    assert sum(summary["sources"].values()) == summary["samples"]
    assert "sources" in format_summary({**summary, "metrics": "m", "plot": None})


def test_a_down_weighted_source_cycles_through_its_rows() -> None:
    """Weights 9 : 11 over 60 + 20 rows: the big source gives 36 entries an epoch, the small
    one 44 (each row twice and 4 draws). Over two epochs the big source gives all 60 rows (36,
    then the other 24 and 12 of its next permutation) and the small one's draws are 8 distinct
    rows, where a fixed draw would repeat 36 rows and 4 rows."""
    big, small = dataset(60, seed=1), dataset(80, seed=2)[60:]  # distinct keys
    mix = Mixture([big, small], ["big", "small"], [9, 11], seed=5)
    run = loader(mix, seq_len=1024, epochs=2)
    keys = Counter(k for b in run for k in b.sample_keys)
    big_keys = {s.key for s in big}
    assert run.accounting["sources"] == {"big": 72, "small": 88}
    assert sorted(n for k, n in keys.items() if k in big_keys) == [1] * 48 + [2] * 12
    assert sorted(n for k, n in keys.items() if k not in big_keys) == [4] * 12 + [5] * 8
