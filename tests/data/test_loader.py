"""Bin stream and loader: accounting, overlong policies, exact resume, rank sharding, workers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.helpers import PAD, make_sample, split_data
from vlpack.data.loader import PackedLoader
from vlpack.data.stream import BinStream, rank_bins
from vlpack.data.types import BadSampleError, EncodedSample, SampleSize


class FakeEncoder:
    """Items are EncodedSamples already (or errors); encode returns them, measure sizes them."""

    class spec:  # noqa: N801 - mimics vlpack.families.Family
        merge_size = 2

    def measure(self, item: EncodedSample) -> SampleSize:
        return item.size

    def encode(self, item: EncodedSample, max_tokens: int | None = None) -> EncodedSample:
        if item.key.startswith("corrupt"):
            raise BadSampleError("corrupt_image", f"{item.key}: corrupt")
        return item if max_tokens is None else self.truncate(item, max_tokens)

    def truncate(self, sample: EncodedSample, max_tokens: int) -> EncodedSample:
        return EncodedSample(
            sample.key, sample.input_ids[:max_tokens], sample.labels[:max_tokens],
            sample.mm_token_type_ids[:max_tokens], sample.image_grid_thw, sample.pixel_values,
        )

    def truncated_size(self, item: EncodedSample, max_tokens: int) -> SampleSize:
        img_end = int(np.flatnonzero(item.mm_token_type_ids).max(initial=-1)) + 2
        if img_end > max_tokens:
            raise BadSampleError("overlong_image", f"{item.key}: cut would split an image")
        return SampleSize(max_tokens, item.num_patches)


def dataset(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            items.append(make_sample(f"t{i}", rng, text=(int(rng.integers(5, 60)),), grids=()))
        elif kind == 4:
            items.append(make_sample(f"m{i}", rng, text=(3, 4, 20), grids=((1, 4, 4), (1, 2, 4))))
        else:
            h, w = (int(x) * 2 for x in rng.integers(1, 6, 2))
            items.append(make_sample(f"s{i}", rng, text=(4, int(rng.integers(5, 40))),
                                     grids=((1, h, w),)))
    return items


def loader(items, **kw) -> PackedLoader:
    """A PackedLoader of `items`; keywords naming a `data.*` field go into its section (whose
    max_bad_fraction=1 lets these deliberately dirty datasets through)."""
    d, run = split_data({**dict(seq_len=128, packing="bfd", buffer_size=16, pad_to_multiple_of=8,
                                overlong="skip", max_bad_fraction=1.0, seed=3, epochs=None,
                                pad_token_id=PAD), **kw})
    return PackedLoader(items, FakeEncoder(), d, **run)


def make_stream(sizes, **kw) -> BinStream:
    """A BinStream over `sizes`; `data.*` keywords form its section, whose pad_to_multiple_of=1
    and max_bad_fraction=1 (unless given) keep the hand-worked numbers below."""
    d, run = split_data({**dict(pad_to_multiple_of=1, max_bad_fraction=1.0, seed=0, epochs=1),
                         **kw})
    return BinStream(sizes=sizes, data=d, **run)


def same(a, b) -> bool:
    return a.sample_keys == b.sample_keys and torch.equal(a.input_ids, b.input_ids) and \
        torch.equal(a.position_ids, b.position_ids)


@pytest.mark.parametrize("policy", ["skip", "truncate"])
@pytest.mark.parametrize("algo", ["greedy", "ffd", "bfd", "none"])
def test_every_sample_is_accounted_for(policy: str, algo: str) -> None:
    items = dataset(60)
    items[7] = BadSampleError("missing_image", "x.jpg is missing")
    items[9] = make_sample("long", np.random.default_rng(0), text=(150,), grids=())
    items[11] = make_sample("longimg", np.random.default_rng(0), text=(130, 10), grids=((1, 8, 8),))
    sizes = [it if isinstance(it, BadSampleError) else it.size for it in items]
    enc = FakeEncoder()
    planned = make_stream(sizes, seq_len=128, packing=algo, batch_size=4, buffer_size=16,
                     overlong=policy, truncate_fn=lambda i, c: enc.truncated_size(items[i], c),
                     pad_to_multiple_of=8)
    bins = list(planned)
    acc = planned.account.as_dict()
    assert acc["samples"] == 60
    assert acc["packed"] + acc["truncated"] + sum(acc["skipped"].values()) == 60
    flat = [i for b in bins for i in b.items]
    assert len(flat) == len(set(flat)) == acc["packed"] + acc["truncated"]
    assert acc["skipped"]["missing_image"] == 1
    if policy == "skip":
        assert acc["skipped"]["overlong"] == 2 and acc["truncated"] == 0
    else:
        assert acc["truncated"] == 1 and acc["skipped"]["overlong_image"] == 1
        assert dict(t for b in bins for t in b.truncate) == {9: 128}
    for b in bins:
        aligned = sum(-(-n // 8) * 8 for n in b.lengths)
        assert algo == "none" or aligned <= 128


def test_overlong_error_names_sample_and_options() -> None:
    items = [make_sample("a", np.random.default_rng(0), text=(300,), grids=())]
    with pytest.raises(ValueError, match=r"sample #1 is overlong.*data\.overlong=truncate\|skip"):
        list(make_stream([items[0].size], seq_len=128))
    # The loader names the sample as every other message does: its id, else file:line.
    with pytest.raises(ValueError, match=r"^a is overlong \(300 tokens > seq_len 128\)"):
        list(loader(items, overlong="error", epochs=1))


def test_max_patches_budget_holds() -> None:
    items = dataset(80)
    for b in make_stream([s.size for s in items], seq_len=256, max_patches=64, overlong="skip"):
        assert b.patches <= 64


def test_resume_continues_the_stream_exactly() -> None:
    items = dataset(40)
    straight = list(itertools.islice(iter(loader(items)), 30))  # > 1 epoch
    first = loader(items)
    it = iter(first)
    for _ in range(11):
        next(it)
    state = first.state_dict()
    resumed = loader(items)
    resumed.load_state_dict(state)
    rest = list(itertools.islice(iter(resumed), 19))
    assert all(same(a, b) for a, b in zip(straight[11:], rest, strict=True))


def test_ranks_get_distinct_balanced_bins_of_the_global_stream() -> None:
    items = dataset(64)
    sizes = [s.size for s in items]

    def global_stream():
        return iter(make_stream(sizes, seq_len=128, buffer_size=16, overlong="skip"))

    everything = [b.items for b in global_stream()]
    per_rank = [[b.items for b in rank_bins(global_stream(), rank=r, world_size=2, per_round=2)]
                for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    got = per_rank[0] + per_rank[1]
    assert len(set(got)) == len(got)
    assert set(got) <= set(everything) and len(everything) - len(got) < 4  # tail round only
    for k in range(0, len(per_rank[0]), 2):
        round_ = set(everything[2 * k : 2 * k + 4])
        assert set(per_rank[0][k : k + 2]) | set(per_rank[1][k : k + 2]) == round_


def test_encode_time_failure_is_counted_and_bin_still_built() -> None:
    items = dataset(20)
    items[3] = make_sample("corrupt3", np.random.default_rng(1), text=(5, 6), grids=((1, 2, 2),))
    ld = loader(items, epochs=1, shuffle=False)
    batches = list(ld)
    keys = [k for b in batches for k in b.sample_keys]
    assert "corrupt3" not in keys
    acc = ld.accounting
    assert acc["skipped"]["corrupt_image"] == 1
    assert acc["packed"] + acc["truncated"] + sum(acc["skipped"].values()) == 20


def test_samples_that_fail_to_encode_are_held_to_the_bad_sample_limits() -> None:
    """Samples that measure fine and fail to encode (an image whose header reads and whose body
    does not) stop the run like those that fail while planning: after
    `data.max_consecutive_bad` in a row, or past `data.max_bad_fraction` of those consumed."""
    rng = np.random.default_rng(1)

    def corrupt(n: int) -> list:
        return [make_sample(f"corrupt{i}", rng, text=(5, 6), grids=((1, 2, 2),)) for i in range(n)]

    with pytest.raises(ValueError, match=r"6 bad samples in a row \(last: corrupt_image: "
                                         r"corrupt.*data\.max_consecutive_bad"):
        list(loader(corrupt(40), epochs=1, shuffle=False, max_consecutive_bad=5))
    items = dataset(200)
    for i in range(0, 200, 4):  # every 4th: 25%
        items[i] = corrupt(1)[0]
    with pytest.raises(ValueError, match=r"of \d+ samples were skipped.*max_bad_fraction=0\.1"):
        list(loader(items, epochs=1, shuffle=False, max_bad_fraction=0.1))
    ld = loader(items, epochs=1, shuffle=False, max_bad_fraction=0.3)  # within the tolerance
    assert sum(len(b.sample_keys) for b in ld) == 150
    assert ld.accounting["skipped"] == {"corrupt_image": 50}


def test_checking_a_pass_names_every_kind_of_skip_over_all_ranks_bins() -> None:
    """`check_pass` on a split of 8 (one bad, two overlong under data.overlong=skip, 3 of 8 past
    max_bad_fraction=0.25), as rank 1 of 2: the refusal names the split and all three samples,
    the overlong ones too, whichever rank's bin would carry them; within the limit it passes
    and encodes nothing."""
    rng = np.random.default_rng(2)
    items = [make_sample(f"ok{i}", rng, text=(11,), grids=()) for i in range(5)]
    items += [make_sample(f"long{i}", rng, text=(150,), grids=()) for i in range(2)]
    sizes = [it.size for it in items] + [BadSampleError("missing_image", "gone: x.jpg missing")]
    items.append(items[0])  # never read: its size is the error
    ld = loader(items, sizes=sizes, epochs=1, shuffle=False, rank=1, world_size=2,
                max_bad_fraction=0.25)
    with pytest.raises(ValueError, match=r"^the split: 3 of 8 samples were skipped .*Bad samples: "
                                         r"(?=.*long0: overlong)(?=.*long1: overlong)"
                                         r"(?=.*gone: x\.jpg missing)"):
        ld.check_pass("the split")
    encoded: list = []
    ok = loader(items, sizes=sizes, epochs=1, shuffle=False, max_bad_fraction=0.5)
    ok.encoder.encode = lambda *a, **k: encoded.append(a)
    ok.check_pass("the split")
    assert encoded == []


def test_a_sample_that_turns_bad_after_measuring_is_counted() -> None:
    """A record re-read by a worker can parse as an error where it measured fine (its image
    swapped for a link out of the media root in between): the bin skips and counts it."""

    class Swapped(list):  # measuring iterates; a worker indexes
        def __getitem__(self, i):
            if i == 3:
                return BadSampleError("media_outside_root", "s3: image now outside the root")
            return super().__getitem__(i)

    items = Swapped(dataset(20))
    ld = loader(items, epochs=1, shuffle=False)
    keys = [k for b in ld for k in b.sample_keys]
    assert "s3" not in keys and len(keys) == 19
    assert ld.accounting["skipped"] == {"media_outside_root": 1}


def test_padded_mode_yields_padded_batches() -> None:
    items = dataset(12)
    batches = list(loader(items, packing="none", batch_size=4, epochs=1, shuffle=False))
    assert [b.num_samples for b in batches] == [4, 4, 4]
    assert batches[0].input_ids.shape[0] == 4


def test_rows_take_their_shape_from_the_data_section() -> None:
    """data.pad_to_seq_len pads every packed row to seq_len (the padding joining the last
    segment); data.pad_to_multiple_of aligns every segment; packing=none ignores seq_len."""
    items = dataset(30)
    for mult in (8, 16):
        rows = list(loader(items, epochs=1, pad_to_seq_len=True, pad_to_multiple_of=mult))
        assert rows and {r.input_ids.numel() for r in rows} == {128}
        assert all((torch.diff(r.cu_seqlens_padded) % mult == 0).all() for r in rows)
    free = [r.input_ids.numel() for r in loader(items, epochs=1)]
    assert max(free) <= 128 and min(free) < 128
    padded = list(loader(items, packing="none", batch_size=4, pad_to_seq_len=True, epochs=1))
    assert all(b.input_ids.shape[1] < 128 for b in padded)


def test_workers_give_the_same_stream() -> None:
    items = dataset(30)
    a = list(itertools.islice(iter(loader(items)), 8))
    b = list(itertools.islice(iter(loader(items, num_workers=2)), 8))
    assert all(same(x, y) for x, y in zip(a, b, strict=True))


def test_a_skip_the_look_ahead_meets_in_the_next_epoch_rides_on_that_epoch() -> None:
    """Two epochs of [bad, 10, 10, 10] tokens in order, one bin per epoch (buffer 8, 64-token
    bins): planning epoch 1's bin meets epoch 1's copy of the bad sample before it emits epoch
    0's bin (the repeat of sample 1 flushes it). That bin carries epoch 0's skip only; epoch
    1's skip rides on epoch 1's bin, so a run that stops after the first bin has counted one
    skip, as one bad sample was in what it trained."""
    sizes = [BadSampleError("missing_image", "x.jpg"), *[SampleSize(10, 0)] * 3]
    bins = list(make_stream(sizes, seq_len=64, shuffle=False, epochs=2, buffer_size=8))
    assert [(b.items, b.epochs) for b in bins] == [((1, 2, 3), (0, 0, 0)),
                                                   ((1, 2, 3), (1, 1, 1))]
    assert [[(s.index, s.epoch) for s in b.skips] for b in bins] == [[(0, 0)], [(0, 1)]]


def test_consecutive_bad_samples_fail_the_run() -> None:
    sizes = [BadSampleError("missing_image", f"img{i}.jpg is missing") for i in range(5)]
    sizes += [SampleSize(10, 0)] * 5
    ok = make_stream(sizes, seq_len=128, shuffle=False, max_consecutive_bad=5)
    assert sum(len(b.items) for b in ok) == 5
    bad = make_stream(sizes, seq_len=128, shuffle=False, max_consecutive_bad=4)
    with pytest.raises(ValueError, match=r"5 bad samples in a row.*data\.max_consecutive_bad"):
        list(bad)


def test_bad_fraction_fails_the_run() -> None:
    sizes = [BadSampleError("corrupt_image", "x") if i % 4 == 0 else SampleSize(10, 0)
             for i in range(200)]
    with pytest.raises(ValueError, match=r"data\.max_bad_fraction=0\.2"):
        list(make_stream(sizes, seq_len=128, max_bad_fraction=0.2))
    assert list(make_stream(sizes, seq_len=128, max_bad_fraction=0.3))


def test_bad_fraction_applies_to_a_tiny_file() -> None:
    """16 samples, 13 bad: far fewer than the 100 a larger file is judged after, so the
    fraction applies once all 16 were seen; the message carries the counts."""
    sizes = [SampleSize(10, 0) if i % 5 == 0 else BadSampleError("missing_image", "x")
             for i in range(16)]
    assert sum(isinstance(s, BadSampleError) for s in sizes) == 12
    sizes[1] = BadSampleError("bad_schema", "y")
    sizes[5] = BadSampleError("bad_schema", "y")  # 13 bad, the last sample good
    with pytest.raises(ValueError, match=r"13 of 16 samples were skipped .*'bad_schema': 2.*"
                                         r"data\.max_bad_fraction=0\.05"):
        list(make_stream(sizes, seq_len=128, shuffle=False, max_bad_fraction=0.05,
                    max_consecutive_bad=32))
