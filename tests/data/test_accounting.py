"""Skip accounting: every sample counted once per epoch, by the rank that consumes it, summed
over ranks; each skip printed once with the sample's name; nothing planned ahead is counted."""

from __future__ import annotations

import itertools
import logging

import numpy as np

from tests.data.test_loader import dataset, loader
from tests.helpers import make_sample
from vlpack.data.accounting import MAX_PRINTED, Tally


def dirty(n: int = 46, every: int = 4) -> tuple[list, set[str]]:
    """`n` samples, every `every`-th one failing to encode (a corrupt image body)."""
    items = dataset(n)
    bad = set()
    for i in range(0, n, every):
        items[i] = make_sample(f"corrupt{i}", np.random.default_rng(i), text=(5, 6),
                               grids=((1, 2, 2),))
        bad.add(f"corrupt{i}")
    return items, bad


def overlong(items: list, at: tuple[int, ...]) -> set[str]:
    """Make the samples at `at` longer than seq_len=128 (skipped while planning)."""
    rng = np.random.default_rng(7)
    for i in at:
        items[i] = make_sample(f"long{i}", rng, text=(150,), grids=())
    return {f"long{i}" for i in at}


def test_each_sample_counted_once_per_epoch_summed_over_ranks(caplog) -> None:
    items, bad = dirty()
    too_long = overlong(items, (1, 2, 9))
    caplog.set_level(logging.WARNING, logger="vlpack.data")
    ranks = [loader(items, rank=r, world_size=2) for r in (0, 1)]
    for ld in ranks:  # three epochs' worth of bins, so the first two are complete
        for _ in itertools.islice(iter(ld), 3 * 46 // 2):
            pass
    run = Tally.merged([ld.tally.state() for ld in ranks]).as_dict()
    for e in (0, 1):
        epoch = run["epochs"][e]
        assert epoch["samples"] == 46, epoch
        assert epoch["skipped"] == {"corrupt_image": len(bad), "overlong": len(too_long)}
        assert epoch["packed"] == 46 - len(bad) - len(too_long)
    # Each bad sample is printed once, by the rank that met it, naming it; later epochs are
    # counted only.
    lines = [r.getMessage() for r in caplog.records]
    for key in bad | too_long:
        hits = [x for x in lines if f" {key}: " in x]
        assert len(hits) == 1, (key, hits)
        assert hits[0].startswith(("rank 0: ", "rank 1: "))
    # Both ranks carry their share of the counts (one rank alone is not the run).
    assert all(ld.accounting["samples"] < run["samples"] for ld in ranks)


def test_samples_planned_ahead_are_not_counted() -> None:
    items, _ = dirty()
    ld = loader(items, buffer_size=32)
    it = iter(ld)
    next(it)
    plan_seen = ld.stream.account.seen
    acc = ld.accounting
    assert acc["samples"] < plan_seen  # the planner looked ahead; the tally did not
    first = next(iter(loader(items, buffer_size=32).builder[w] for w in loader(
        items, buffer_size=32)._works(0)))[1]
    assert acc["samples"] == len(first.items) + len(first.skips)


def test_truncated_then_failed_sample_is_one_skip() -> None:
    """A sample cut to fit (overlong=truncate) whose image then fails to decode counts once, as
    skipped, and not as truncated."""
    items = dataset(20)
    rng = np.random.default_rng(5)
    items[3] = make_sample("corrupt-long", rng, text=(4, 160), grids=((1, 2, 2),))
    ld = loader(items, overlong="truncate", epochs=1, shuffle=False)
    list(ld)
    acc = ld.accounting
    assert acc["skipped"] == {"corrupt_image": 1}
    assert acc["truncated"] == 0
    assert acc["samples"] == 20


def test_skip_printing_is_bounded(caplog) -> None:
    items = dataset(120)
    for i in range(0, 120, 2):
        items[i] = make_sample(f"corrupt{i}", np.random.default_rng(i), text=(5, 6),
                               grids=((1, 2, 2),))
    caplog.set_level(logging.WARNING, logger="vlpack.data")
    list(loader(items, epochs=1, max_consecutive_bad=200))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == MAX_PRINTED + 1
    assert "vlpack data validate" in lines[-1]


def test_tally_resumes_from_the_checkpoint_state() -> None:
    items, _ = dirty()
    full = loader(items)
    for _ in itertools.islice(iter(full), 20):
        pass
    part = loader(items)
    for _ in itertools.islice(iter(part), 8):
        pass
    resumed = loader(items)
    resumed.load_state_dict(part.state_dict())
    for _ in itertools.islice(iter(resumed), 12):
        pass
    assert resumed.accounting == full.accounting


def test_a_skip_cannot_forge_log_lines(caplog) -> None:
    """A sample's id is the dataset's text: its newlines, terminal escapes and bidi overrides
    are printed as escapes, so one skip is one log line that says what it is."""
    items = dataset(8)
    items[2] = make_sample("corrupt\nvlpack: step 9 loss 0.01\x1b[2K\u202e", np.random.default_rng(2),
                           text=(5, 6), grids=((1, 2, 2),))
    caplog.set_level(logging.WARNING, logger="vlpack.data")
    list(loader(items, epochs=1))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line and "\u202e" not in line
    assert "corrupt\\nvlpack: step 9 loss 0.01\\x1b[2K\\u202e" in line
