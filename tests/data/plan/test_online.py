"""OnlinePlanner: exactly-once, budgets, bounds, determinism, resume, and carry beats flushing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlpack.data.plan import OnlinePlanner, bin_stats, plan_bins

CAP, MAXP = 64, 48


def receipts(n: int, seed: int) -> list[int]:
    """Receipt-like token counts (as in test_algorithms.py): text 150-600 + 0/1/2 images of
    100-2000 tokens (log-uniform; 15% / 70% / 15%)."""
    rng = np.random.default_rng(seed)
    k = rng.choice(3, size=n, p=[0.15, 0.7, 0.15])
    img = np.exp(rng.uniform(np.log(100), np.log(2000), (n, 2))).astype(int)
    return (rng.integers(150, 601, n) + (img * (np.arange(2) < k[:, None])).sum(1)).tolist()

streams = st.lists(st.tuples(st.integers(1, CAP), st.integers(0, MAXP)), max_size=120)
configs = st.fixed_dictionaries(
    {
        "algo": st.sampled_from(["greedy", "ffd", "bfd"]),
        "buffer_size": st.integers(1, 24),
        "min_fill": st.sampled_from([0.0, 0.8, 0.95, 1.0]),
        "max_patches": st.sampled_from([None, MAXP]),
        "seed": st.integers(0, 3),
        "max_wait_rounds": st.integers(1, 4),
    }
)


def make(cfg: dict) -> OnlinePlanner:
    return OnlinePlanner(CAP, **cfg)


def run(planner: OnlinePlanner, stream, start: int = 0) -> list[list[int]]:
    """Pushes stream[start:] (item ids are stream positions); returns bins incl. the flush."""
    out: list[list[int]] = []
    for i in range(start, len(stream)):
        t, p = stream[i]
        out += planner.push(i, t, p)
        assert len(planner) < planner.buffer_size, "buffer bounded"
    return out + planner.flush()


@settings(max_examples=60, deadline=None)
@given(streams, configs)
def test_exactly_once_budgets_bounds(stream, cfg):
    pl = make(cfg)
    emitted_round: dict[int, int] = {}
    out: list[list[int]] = []
    for i, (t, p) in enumerate(stream):
        got = pl.push(i, t, p)
        if got:
            assert len(pl) <= pl.max_carry, "carry bounded after a round"
            for b in got:
                for j in b:
                    emitted_round[j] = i
        out += got
    out += pl.flush()
    assert len(pl) == 0
    assert sorted(j for b in out for j in b) == list(range(len(stream)))
    for b in out:
        assert b and sum(stream[j][0] for j in b) <= CAP
        if cfg["max_patches"] is not None:
            assert sum(stream[j][1] for j in b) <= MAXP
    assert run(make(cfg), stream) == out, "deterministic"


@settings(max_examples=60, deadline=None)
@given(streams, configs, st.data())
def test_resume_from_state_dict_continues_identically(stream, cfg, data):
    full = run(make(cfg), stream)
    cut = data.draw(st.integers(0, len(stream)))
    first = make(cfg)
    head: list[list[int]] = []
    for i in range(cut):
        head += first.push(i, *stream[i])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make(cfg)
    resumed.load_state_dict(state)
    assert head + run(resumed, stream, start=cut) == full


@settings(max_examples=40, deadline=None)
@given(streams, configs, st.lists(st.integers(0, 40), max_size=8))
def test_extend_equals_push(stream, cfg, chunks):
    pl, out, pos = make(cfg), [], 0
    for c in [*chunks, len(stream)]:
        part = range(pos, min(pos + c, len(stream)))
        out += pl.extend(part, [stream[i][0] for i in part], [stream[i][1] for i in part])
        pos = part.stop
    assert out + pl.flush() == run(make(cfg), stream)


def test_extend_checks_everything_first():
    pl = OnlinePlanner(10, "ffd", 4)
    with pytest.raises(ValueError, match="item 12 has 11 tokens"):
        pl.extend([10, 11, 12], [3, 4, 11])
    assert len(pl) == 0


@settings(max_examples=25, deadline=None)
@given(streams, configs)
def test_seed_changes_order_not_bins(stream, cfg):
    a = run(make({**cfg, "seed": 0}), stream)
    b = run(make({**cfg, "seed": 1}), stream)
    assert sorted(a) == sorted(b)


def test_max_wait_rounds_bounds_latency():
    # Items of 1 token in bins of 64 never reach min_fill: only age and max_carry release them.
    pl = OnlinePlanner(CAP, "ffd", 8, min_fill=1.0, max_carry=7, max_wait_rounds=2)
    pushed_round: dict[int, int] = {}
    for i in range(200):
        pushed_round[i] = pl._round
        for b in pl.push(i, 1):
            for j in b:
                assert pl._round - 1 - pushed_round[j] <= 2
    assert len(pl) < 8


def test_progress_when_nothing_fills():
    pl = OnlinePlanner(1000, "greedy", 16, min_fill=1.0, max_wait_rounds=100)
    seen = 0
    for i in range(1000):
        seen += sum(len(b) for b in pl.push(i, 3))
        assert len(pl) < 16
    assert seen + sum(len(b) for b in pl.flush()) == 1000


def flush_every_buffer(lens, capacity, algo, buffer_size):
    """The per-buffer reference: plan each full buffer and emit all its bins."""
    bins = []
    for s in range(0, len(lens), buffer_size):
        bins += [[s + i for i in b] for b in plan_bins(lens[s : s + buffer_size], capacity, algo)]
    return bins


@pytest.mark.parametrize("algo", ["greedy", "ffd", "bfd"])
def test_carry_beats_flushing_every_buffer(algo):
    lens = receipts(20_000, seed=5)
    ref = bin_stats(flush_every_buffer(lens, 8192, algo, 256), lens, 8192)
    pl = OnlinePlanner(8192, algo, 256)
    bins = pl.extend(range(len(lens)), lens) + pl.flush()
    ours = bin_stats(bins, lens, 8192)
    assert ours["efficiency"] > ref["efficiency"] + 0.005
    pl = OnlinePlanner(8192, algo, 512)
    assert bin_stats(pl.extend(range(len(lens)), lens) + pl.flush(), lens, 8192)[
        "efficiency"
    ] >= 0.99


def test_errors():
    with pytest.raises(ValueError, match="choose one of"):
        OnlinePlanner(10, "nf", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_carry"):
        OnlinePlanner(10, "ffd", 4, max_carry=4)
    pl = OnlinePlanner(10, "ffd", 4, max_patches=5)
    pl.push(1, 4)
    pl.push(2, 5, 5)
    with pytest.raises(ValueError, match=r"item 77 has 11 tokens.*overlong policy"):
        pl.push(77, 11)
    with pytest.raises(ValueError, match="item 78 has 6 ViT patches"):
        pl.push(78, 3, 6)
    assert len(pl) == 2, "one bad item never costs the buffer (Energon drops the whole buffer)"
    assert sorted(i for b in pl.flush() for i in b) == [1, 2]
    other = OnlinePlanner(10, "ffd", 8, max_patches=5)
    with pytest.raises(ValueError, match="buffer_size=4 but this planner has buffer_size=8"):
        other.load_state_dict(pl.state_dict())
