"""The loader: source → measure → plan (stream.py) → encode → batch, for one data-parallel rank.

Sizes of all samples are measured once up front from image headers (no pixel decode), so the
plan is a pure function of lengths and the stream position is one integer (`bins` consumed).
Encoding — the expensive part (image decode, resize, patchify) — runs in DataLoader workers,
in plan order. A sample that fails only at encode time (a corrupt image body) is dropped from
its bin and counted; a bin that loses every sample becomes a one-token filler so every rank
still takes the same number of steps.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from vlpack.data.batch import ThdBatch, build_thd_batch
from vlpack.data.padded import PaddedBatch, build_padded_batch
from vlpack.data.stream import BinStream, PlannedBin, SizeOrError, rank_bins
from vlpack.data.types import BadSampleError, Conversation, EncodedSample

log = logging.getLogger(__name__)

Item = Conversation | BadSampleError


def open_dataset(source: str, path: str | None, *, synthetic_samples: int = 256) -> list[Item]:
    """All records of a dataset, good ones as Conversation, bad ones as their error."""
    from vlpack.data.sources import iter_jsonl

    if source == "synthetic":
        from vlpack.data.synth import default_dataset

        path = str(default_dataset(n=synthetic_samples))
    elif source != "jsonl":
        raise ValueError(f"data.source={source!r} is not readable here; use jsonl or synthetic")
    return list(iter_jsonl(path))


def measure_all(items: Sequence[Item], encoder, *, progress: bool = False) -> list[SizeOrError]:
    """Exact size of every sample from image headers; bad samples become their error."""
    out: list[SizeOrError] = []
    for item in tqdm(items, desc="measuring samples", disable=not progress, unit="sample"):
        if isinstance(item, BadSampleError):
            out.append(item)
            continue
        try:
            out.append(encoder.measure(item))
        except BadSampleError as e:
            out.append(e)
    return out


@dataclass(frozen=True, slots=True)
class BinWork:
    """What a worker needs to build one batch (picklable)."""

    plan: PlannedBin
    packed: bool


class _BinBuilder(torch.utils.data.Dataset):
    """Map-style dataset indexed by BinWork: encodes the bin's samples and builds the batch."""

    def __init__(self, items, encoder, *, pad_token_id, pad_to_multiple_of, total_len, merge):
        self.items, self.encoder = items, encoder
        self.pad_token_id, self.mult, self.total_len, self.merge = (
            pad_token_id, pad_to_multiple_of, total_len, merge
        )

    def __len__(self) -> int:  # pragma: no cover - sampler-driven, never sized
        raise TypeError("bins are streamed")

    def __getitem__(self, work: BinWork) -> tuple[ThdBatch | PaddedBatch, Counter]:
        caps = dict(work.plan.truncate)
        samples: list[EncodedSample] = []
        skipped: Counter = Counter()
        for i in work.plan.items:
            try:
                sample = self.encoder.encode(self.items[i])
                if i in caps:
                    sample = self.encoder.truncate(sample, caps[i])
            except BadSampleError as e:
                log.warning("skipping sample at encode time: %s", e)
                skipped[e.reason] += 1
                continue
            samples.append(sample)
        if not samples:
            samples = [EncodedSample.filler(self.pad_token_id)]
        if work.packed:
            batch = build_thd_batch(
                samples, pad_token_id=self.pad_token_id, pad_to_multiple_of=self.mult,
                total_len=self.total_len, spatial_merge_size=self.merge,
            )
        else:
            batch = build_padded_batch(samples, pad_token_id=self.pad_token_id)
        return batch, skipped


def _identity(x):
    return x


class _WorkSampler(torch.utils.data.Sampler):
    def __init__(self, works: Iterator[BinWork]):
        self.works = works

    def __iter__(self):
        return self.works


class PackedLoader:
    """Iterable of this rank's batches (ThdBatch, or PaddedBatch when packing is `none`).

    `state_dict()` holds the number of batches handed out; a loader restored from it continues
    with exactly the batches the original would have produced next.
    """

    def __init__(
        self,
        items: Sequence[Item],
        encoder,
        *,
        sizes: Sequence[SizeOrError] | None = None,
        seq_len: int,
        packing: str = "bfd",
        batch_size: int = 1,
        buffer_size: int = 256,
        max_patches: int | None = None,
        pad_to_multiple_of: int = 1,
        total_len: int | None = None,
        overlong: str = "error",
        max_consecutive_bad: int | None = None,
        max_bad_fraction: float | None = None,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        per_round: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        pad_token_id: int,
        spatial_merge_size: int = 2,
        progress: bool = False,
    ):
        self.items = items
        self.encoder = encoder
        self.sizes = sizes if sizes is not None else measure_all(items, encoder, progress=progress)
        self.packed = packing != "none"
        self.stream_kw = dict(
            seq_len=seq_len, algo=packing, batch_size=batch_size, buffer_size=buffer_size,
            max_patches=max_patches, pad_to_multiple_of=pad_to_multiple_of, overlong=overlong,
            truncate_fn=self._truncated_size, seed=seed, shuffle=shuffle, epochs=epochs,
            max_consecutive_bad=max_consecutive_bad, max_bad_fraction=max_bad_fraction,
        )
        self.rank, self.world_size, self.per_round = rank, world_size, per_round
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.builder = _BinBuilder(
            items, encoder, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of,
            total_len=total_len if self.packed else None, merge=spatial_merge_size,
        )
        self.consumed = 0
        self.encode_skipped: Counter = Counter()
        self.stream: BinStream | None = None

    def _truncated_size(self, i: int, max_tokens: int):
        return self.encoder.truncated_size(self.items[i], max_tokens)

    def _works(self, skip: int) -> Iterator[BinWork]:
        self.stream = BinStream(sizes=self.sizes, **self.stream_kw)
        bins = rank_bins(
            iter(self.stream), rank=self.rank, world_size=self.world_size, per_round=self.per_round
        )
        for n, plan in enumerate(bins):
            if n >= skip:
                yield BinWork(plan, self.packed)

    def __iter__(self) -> Iterator[ThdBatch | PaddedBatch]:
        works = self._works(self.consumed)
        if self.num_workers == 0:
            results = (self.builder[w] for w in works)
        else:
            results = iter(
                torch.utils.data.DataLoader(
                    self.builder, sampler=_WorkSampler(works), batch_size=None,
                    num_workers=self.num_workers, collate_fn=_identity,
                    pin_memory=self.pin_memory, prefetch_factor=4, persistent_workers=False,
                )
            )
        for batch, skipped in results:
            self.consumed += 1
            self.encode_skipped.update(skipped)
            yield batch

    @property
    def accounting(self) -> dict:
        """Samples seen by the planner so far: packed, truncated, skipped by reason (planning
        and encode-time skips merged)."""
        acc = self.stream.account.as_dict() if self.stream else {"samples": 0, "packed": 0,
                                                                  "truncated": 0, "skipped": {}}
        skipped = Counter(acc["skipped"])
        skipped.update(self.encode_skipped)
        acc["packed"] -= sum(self.encode_skipped.values())
        acc["skipped"] = dict(sorted(skipped.items()))
        return acc

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "encode_skipped": dict(self.encode_skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
        self.encode_skipped = Counter(state.get("encode_skipped", {}))
