"""The loader: source → measure → plan (stream.py) → encode → batch, for one data-parallel rank.

Sizes of all samples are measured once up front from image headers (no pixel decode), so the
plan is a pure function of lengths and the stream position is one integer (`bins` consumed).
Encoding — the expensive part (image decode, resize, patchify) — runs in DataLoader workers,
in plan order. A sample that fails only at encode time (a corrupt image body) is dropped from
its bin and counted; a bin that loses every sample becomes a one-token filler so every rank
still takes the same number of steps. Each rank tallies the bins it consumes (accounting.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vlpack.config import DataConfig
from vlpack.data.accounting import PACKED, TRUNCATED, Skip, SkipReporter, Tally
from vlpack.data.admission import BadLimits, DataLimitError
from vlpack.data.batch import ThdBatch, packed_row
from vlpack.data.media import DataFile
from vlpack.data.mixture import EntrySizes, Mixture
from vlpack.data.padded import PaddedBatch, build_padded_batch
from vlpack.data.size_cache import measure_one, measuring_bar
from vlpack.data.stream import BinStream, PlannedBin, SizeOrError, rank_bins
from vlpack.data.types import BadSampleError, Conversation, EncodedSample

Item = Conversation | BadSampleError


def open_dataset(source: str, file: DataFile | str | Path | None, *,
                 synthetic_samples: int | None = None) -> Sequence[Item]:
    """All records of a dataset, good ones as Conversation, bad ones as their error (media
    paths must resolve inside the file's media root; a bare path: the data file's folder),
    read and parsed when indexed: a JSONL file by `jsonl_rows.JsonlRows`, a Hugging Face
    dataset (`hf`) by `hf_source.HFRows`, the built-in set (`synthetic`, no file, its media
    inside its own folder) of `synthetic_samples` samples (which that source needs:
    `data.synthetic_samples`). The rows hold the `DataFile` they read (`rows.file`)."""
    from vlpack.data.jsonl_rows import JsonlRows

    if source == "synthetic":
        from vlpack.data.synth import default_dataset

        if synthetic_samples is None:
            raise ValueError("open_dataset('synthetic', ...) reads the built-in set: pass "
                             "synthetic_samples=N (the run's data.synthetic_samples)")

        file = default_dataset(n=synthetic_samples)
    elif source == "hf":
        from vlpack.data.hf_source import HFRows

        rows = HFRows(file)
        if not len(rows):
            raise ValueError(f"data.path={rows.path} holds no rows")
        return rows
    elif source != "jsonl":
        raise ValueError(f"data.source={source!r} is not readable here; use jsonl, hf or "
                         "synthetic")
    items = JsonlRows(file)
    warn_if_broad(items.file.root, "data.media_root")
    if not len(items):
        raise ValueError(f"data file {items.path} holds no records: each line must hold one "
                         "JSON conversation (see docs/data.md)")
    return items


def warn_if_broad(root: Path, setting: str) -> None:
    """Warn when the media root is the file system's root or the home folder: every file under
    it that decodes as an image can then enter training and `energon-prepare` shards."""
    real = root.resolve()
    if real == Path(real.anchor) or real == Path.home().resolve():
        logging.getLogger("vlpack.data").warning(
            "media paths may name any file under %s (%s: by default the data file's folder): "
            "put the data file beside its media, or set data.media_root (--media-root) to the "
            "folder that holds them", real, setting)


def data_file(path: str | None, d: DataConfig) -> DataFile | None:
    """`path` (`data.path` or a `data.mix` source's) with its media inside `data.media_root`
    (None: the file's folder); None without a path (the synthetic set)."""
    return None if path is None else DataFile.of(path, d.media_root)


def open_mix(d: DataConfig, seed: int) -> Mixture:
    """The weighted mixture of `data.mix`'s sources, drawn with `seed` (data/mixture.py); each
    source's media inside `data.media_root`, by default its own folder."""
    sources = [open_dataset(m.source, data_file(m.path, d),
                            synthetic_samples=d.synthetic_samples) for m in d.mix]
    return Mixture(sources, [m.name for m in d.mix], [m.weight for m in d.mix], seed)


BAD_NAMED = 5
"""Bad samples a split's refusal names (`PackedLoader.check_pass`); `vlpack data validate`
lists them all."""


def describe(item, i: int) -> str:
    """How messages name item `i`: a Conversation's id and/or file:line, an encoded sample's
    key, else its 1-based position."""
    name = getattr(item, "name", None) or getattr(item, "key", None)
    return name if name is not None else f"sample #{i + 1}"


def measure_all(items: Sequence[Item], encoder, *, show_progress: bool = False) -> list[SizeOrError]:
    """Exact size of every sample from image headers; bad samples become their error."""
    out: list[SizeOrError] = []
    with measuring_bar(len(items), show_progress) as bar:
        for item in items:
            out.append(measure_one(item, encoder))
            bar.update(1)
    return out


def data_fingerprints(d: DataConfig) -> dict[str, str]:
    """The content fingerprint of each data file or folder the run reads (`data.path` or each
    `data.mix` path of a `jsonl` or `hf` source), by path: what a checkpoint records so that a
    resume notices edited data."""
    from vlpack.data.size_cache import source_fingerprint

    return {path: source_fingerprint(path) for source, path in data_sources(d)
            if source in ("jsonl", "hf") and path is not None and Path(path).exists()}


def data_sources(d: DataConfig) -> list[tuple[str, str | None]]:
    """(source, path) of each source the run reads: `data.mix`'s, or `data.source` and
    `data.path`."""
    return [(m.source, m.path) for m in d.mix] if d.mix else [(d.source, d.path)]


def measure_sources(d: DataConfig, items: Sequence[Item], encoder, *, rank: int = 0,
                    show_progress: bool = False) -> Sequence[SizeOrError]:
    """`measure_all` of `items` (a source or a `data.mix` of them, as `open_dataset` and
    `open_mix` give them), each source's sizes read from the size cache (keyed by the
    `DataFile` the source read) or measured with `data.num_workers` processes and cached
    (size_cache.py)."""
    from vlpack.data.size_cache import sample_sizes

    def one(rows) -> Sequence[SizeOrError]:
        return sample_sizes(rows, encoder, rows.file, workers=d.num_workers, rank=rank,
                            show_progress=show_progress)

    if isinstance(items, Mixture):
        return EntrySizes(items, [one(rows) for rows in items.sources])
    return one(items)


@dataclass(frozen=True, slots=True)
class BinWork:
    """What a worker needs to build one batch (picklable)."""

    plan: PlannedBin
    packed: bool


class _BinBuilder(torch.utils.data.Dataset):
    """Map-style dataset indexed by BinWork: encodes the bin's samples and builds the batch."""

    def __init__(self, items, encoder, d: DataConfig, *, pad_token_id: int, merge: int):
        self.items, self.encoder, self.data = items, encoder, d
        self.pad_token_id, self.merge = pad_token_id, merge

    def __len__(self) -> int:  # pragma: no cover - sampler-driven, never sized
        raise TypeError("bins are streamed")

    def __getitem__(self, work: BinWork) -> tuple[ThdBatch | PaddedBatch, PlannedBin, list[Skip]]:
        """The bin's batch, its plan, and the samples that failed to encode (dropped from it)."""
        caps = dict(work.plan.truncate)
        samples: list[EncodedSample] = []
        failed: list[Skip] = []
        for i, epoch in zip(work.plan.items, work.plan.epochs, strict=True):
            try:
                item = item_at(self.items, i, epoch)
                if isinstance(item, BadSampleError):  # good when measured, bad when read again
                    raise item
                sample = self.encoder.encode(item, caps.get(i))  # a cut decodes what it keeps
            except BadSampleError as e:
                failed.append(Skip(i, epoch, e.reason, str(e)))
                continue
            samples.append(sample)
        if not samples:
            samples = [EncodedSample.filler(self.pad_token_id)]
        if work.packed:
            batch = packed_row(samples, self.data, pad_token_id=self.pad_token_id,
                               spatial_merge_size=self.merge)
        else:
            batch = build_padded_batch(samples, pad_token_id=self.pad_token_id)
        return batch, work.plan, failed


def item_at(items: Sequence[Item], i: int, epoch: int) -> Item:
    """Sample i of `items` in `epoch` (a mixture's entry i may be another row each epoch)."""
    return items.at(i, epoch) if isinstance(items, Mixture) else items[i]


def _identity(x):
    return x


class _WorkSampler(torch.utils.data.Sampler):
    def __init__(self, works: Iterator[BinWork]):
        self.works = works

    def __iter__(self):
        return self.works


class PackedLoader:
    """Iterable of this rank's batches (ThdBatch, or PaddedBatch when packing is `none`).

    Every packing setting comes from the data section `d` (its packing, seq_len, buffers,
    padding, overlong policy, bad-sample limits, shuffle, num_workers, pad_to_seq_len); the
    arguments after it are what the run supplies: the seed, the passes (`epochs`, None:
    endless), this rank's place, the model's pad id and spatial merge size, the measured
    `sizes` (None: measured here). `state_dict()` holds the number of batches handed out; a
    loader restored from it continues with exactly the batches the original would have
    produced next.
    """

    def __init__(
        self,
        items: Sequence[Item],
        encoder,
        d: DataConfig,
        *,
        seed: int,
        pad_token_id: int,
        epochs: int | None = None,
        sizes: Sequence[SizeOrError] | None = None,
        rank: int = 0,
        world_size: int = 1,
        per_round: int = 1,
        pin_memory: bool = False,
        spatial_merge_size: int = 2,
        show_progress: bool = False,
        report_skips: bool = True,
    ):
        self.items = items
        self.encoder = encoder
        self.data = d
        self.sizes = sizes if sizes is not None else (
            items.measure(lambda rows: measure_all(rows, encoder, show_progress=show_progress))
            if isinstance(items, Mixture) else measure_all(items, encoder, show_progress=show_progress))
        self.packed = d.packing != "none"
        self.stream_kw = dict(data=d, seed=seed, epochs=epochs, truncate_fn=self._truncated_size)
        self.rank, self.world_size, self.per_round = rank, world_size, per_round
        self.num_workers, self.pin_memory = d.num_workers, pin_memory
        self.builder = _BinBuilder(items, encoder, d, pad_token_id=pad_token_id,
                                   merge=spatial_merge_size)
        self.consumed = 0
        self.tally = Tally()
        self.limits = BadLimits.of(d, len(items))
        """The bad-sample limits over consumed bins: the stream holds samples that fail while
        planning to them, this holds those that fail to encode, and the share of both."""
        self.report_skip = SkipReporter(rank if world_size > 1 else None) if report_skips \
            else (lambda skip: None)  # another rank with the same data prints them
        self.stream: BinStream | None = None

    def _item(self, i: int) -> Item:
        """Sample i of the epoch the stream plans (a mixture's row can change per epoch)."""
        return item_at(self.items, i, self.stream.epoch if self.stream is not None else 0)

    def _truncated_size(self, i: int, max_tokens: int):
        return self.encoder.truncated_size(self._item(i), max_tokens)

    def _describe(self, i: int) -> str:
        return describe(self._item(i), i)

    def _new_stream(self) -> BinStream:
        """A fresh plan of this loader's stream, the one `_item` reads the epoch of."""
        self.stream = BinStream(sizes=self.sizes, describe=self._describe, **self.stream_kw)
        return self.stream

    def _works(self, skip: int) -> Iterator[BinWork]:
        bins = rank_bins(
            iter(self._new_stream()), rank=self.rank, world_size=self.world_size, per_round=self.per_round
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
        for batch, plan, failed in results:
            self.consumed += 1
            self._count(plan, failed)
            yield batch

    def _count(self, plan: PlannedBin, failed: list[Skip]) -> None:
        """Tally one consumed bin: its trained samples, and the skips it carries; then hold
        the samples that failed to encode to the bad-sample limits (DataLimitError)."""
        lost = {s.index for s in failed}
        caps = dict(plan.truncate)
        source = self.items.source_name if isinstance(self.items, Mixture) else None
        for i, epoch in zip(plan.items, plan.epochs, strict=True):
            if i not in lost:
                self.tally.add(epoch, TRUNCATED if i in caps else PACKED)
                self.limits.good()
                if source is not None:
                    self.tally.add_source(source(i))
        for s in (*plan.skips, *failed):
            self.tally.add(s.epoch, s.reason)
            self.report_skip(s)
        if failed:
            total = self.tally.as_dict()
            for s in failed:
                self.limits.bad(s.reason, s.message, total["skipped"])
            self.limits.check_fraction(total["samples"], total["skipped"])

    def check_pass(self, what: str) -> None:
        """Plan one pass of a loader with `epochs` set (no sample is encoded), so that a split
        whose bad samples break the limits stops the run now, not when the pass is first run:
        DataLimitError naming `what` (the split) and the first bad samples."""
        assert self.stream_kw["epochs"] is not None, "an endless loader has no pass to plan"
        stream = self._new_stream()
        skips: list[Skip] = []
        try:
            for plan in stream:  # every rank's bins: the limits are the whole stream's
                skips += plan.skips
        except DataLimitError as e:
            bad = [s.message for s in (*skips, *stream.unattached_skips)]  # each names its sample
            named = "; ".join(bad[:BAD_NAMED]) + (f"; and {len(bad) - BAD_NAMED} more"
                                                  if len(bad) > BAD_NAMED else "")
            raise DataLimitError(f"{what}: {e}" + (f". Bad samples: {named}" if bad else "")
                                 ) from None

    def summarize_skips(self) -> None:
        """Nothing: this loader prints each skip as it comes (`SkipReporter`)."""

    @property
    def accounting(self) -> dict:
        """This rank's consumed samples: packed, truncated, skipped by reason, in total and per
        epoch (`Tally.as_dict`; add up the ranks' `tally.state()` for the run's)."""
        return self.tally.as_dict()

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "tally": self.tally.state()}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
        self.tally = Tally.from_state(state.get("tally", {}))


def build_loaders(
    d: DataConfig, encoder, *, seed: int, rank: int = 0, world_size: int = 1, per_round: int = 1,
    pad_token_id: int, spatial_merge_size: int, pin_memory: bool = False, show_progress: bool = False,
    report_skips: bool = True,
):
    """The training loader of this rank (endless) and the evaluation loader (one pass over the
    held-out `data.eval_samples` at the end of the dataset, or None), from `data.*`.
    `report_skips=False` counts skipped samples without printing them (a context-parallel
    rank other than its group's first reads the same data)."""
    if d.source == "energon":  # Energon reads and packs (batch-level); one stream per rank
        from vlpack.data.energon import require_energon

        require_energon("data.source=energon")
        from vlpack.data.energon.loader import EnergonLoader

        if d.eval_samples and rank == 0:
            logging.getLogger("vlpack.data").warning(
                "data.eval_samples=%d is ignored with data.source=energon (no held-out split)",
                d.eval_samples)
        return EnergonLoader(encoder, d, seed=seed, pad_token_id=pad_token_id,
                             spatial_merge_size=spatial_merge_size, rank=rank,
                             world_size=world_size, report_skips=report_skips), None
    items = open_mix(d, seed) if d.mix else open_dataset(
        d.source, data_file(d.path, d), synthetic_samples=d.synthetic_samples)
    n_eval = d.eval_samples
    if d.mix and n_eval:  # a held-out tail would share rows with the training draws
        if rank == 0:
            logging.getLogger("vlpack.data").warning(
                "data.eval_samples=%d is ignored with data.mix (no held-out split)", n_eval)
        n_eval = 0
    if n_eval >= len(items):
        raise ValueError(f"data.eval_samples={n_eval} leaves no training samples "
                         f"(the dataset has {len(items)}): lower data.eval_samples")
    n_train = len(items) - n_eval
    sizes = measure_sources(d, items, encoder, rank=rank, show_progress=show_progress)
    common = dict(seed=seed, rank=rank, world_size=world_size, pad_token_id=pad_token_id,
                  spatial_merge_size=spatial_merge_size, pin_memory=pin_memory,
                  report_skips=report_skips)
    train = PackedLoader(items[:n_train], encoder, d, sizes=sizes[:n_train], epochs=None,
                         per_round=per_round, **common)
    evl = None
    if n_eval:  # one ordered pass, encoded in the training process
        evl = PackedLoader(items[n_train:], encoder, replace(d, shuffle=False, num_workers=0),
                           sizes=sizes[n_train:], epochs=1, per_round=1, **common)
        evl.check_pass(f"the held-out split (the last data.eval_samples={n_eval} samples)")
    return train, evl
