"""`EnergonLoader`: this rank's packed rows from a prepared Energon dataset.

The trainer-facing contract of `PackedLoader`: iterating yields `ThdBatch`, `state_dict()` /
`load_state_dict()` continue the stream exactly (Energon's savable loader state, workers
included), `accounting` says where every sample went.

Ranks: Energon splits the dataset's samples over data-parallel ranks and their workers through
its `WorkerConfig` (built from torch.distributed's data-parallel group, or from rank/world_size
given), so each rank reads a distinct stream; no planning is shared across ranks.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import pickle
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from vlpack.config import DataConfig
from vlpack.data.accounting import PACKED, TRUNCATED, Tally
from vlpack.data.admission import BadLimits
from vlpack.data.batch import ThdBatch
from vlpack.data.energon.task_encoder import PackedRow, QwenVLTaskEncoder
from vlpack.data.energon.validate import validate_dataset_folder
from vlpack.data.types import printable
from vlpack.pickles import load_weights_only

log = logging.getLogger(__name__)


def energon_worker_config(
    num_workers: int,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> WorkerConfig:
    """Energon's WorkerConfig for this data-parallel rank: `rank`/`world_size` when given, else
    the rank in `group` (default: the world) of an initialised torch.distributed, else 0 of 1."""
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither (to read torch.distributed)")
    if rank is None:
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            rank, world_size = 0, 1
    assert world_size is not None
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be ≥ 0, got {num_workers}")
    return WorkerConfig(rank=rank, world_size=world_size, num_workers=num_workers,
                        data_parallel_group=group, seed_offset=seed)  # fmt: skip


class _FlexStatePickler(pickle.Pickler):
    """Pickles Energon's `FlexState` (a dict subclass) as a call of its class on a plain dict,
    which `torch.load(weights_only=True)` can rebuild (it sets items on plain dicts only)."""

    def reducer_override(self, obj):
        if type(obj).__name__ == "FlexState" and type(obj).__module__ == "megatron.energon.state":
            return type(obj), (dict(obj),)
        return NotImplemented


class _EnergonPickle:
    """The pickle module `torch.save` writes Energon's state with (`_FlexStatePickler`)."""

    Pickler = _FlexStatePickler
    dump = staticmethod(pickle.dump)
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)


def _energon_state_classes(data: bytes) -> list[type]:
    """The classes Energon's state in `data` names, when each is a dataclass of
    `megatron.energon` or its `FlexState`; anything else stays refused."""
    import dataclasses

    out = []
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)):
        module, _, attr = name.rpartition(".")
        if not module.startswith("megatron.energon."):
            continue
        cls = getattr(importlib.import_module(module), attr, None)
        if isinstance(cls, type) and (dataclasses.is_dataclass(cls) or (
                attr == "FlexState" and cls.__mro__[1:] == (dict, object))):
            out.append(cls)
    return out


def _load_energon_state(data: bytes):
    """Energon's state from `state_dict`'s bytes, read with `weights_only=True`: tensors,
    containers and Energon's state classes only, so a checkpoint cannot make a resume run
    code (a state naming anything else is refused by name)."""
    state, refused = load_weights_only(io.BytesIO(data), _energon_state_classes(data))
    if refused is not None:
        raise ValueError(f"an Energon loader state in this checkpoint names "
                         f"{refused or 'what vlpack does not build'}: resume from a checkpoint "
                         "vlpack wrote")
    return state


SKIP_SUMMARY_S = 300.0
"""Least seconds between two summaries of skipped samples while training."""


class EnergonLoader:
    """Iterable of this rank's `ThdBatch` rows, read and packed by Energon (infinite stream).

    Every setting comes from the data section `d` (data.source=energon, its checks done
    there): `d.path` (the prepared folder, checked by `validate_dataset_folder` before Energon
    reads it), the packing options `PackedLoader` reads, and the
    Energon-specific `packing_buffer_size` (samples planned together; None: buffer_size),
    `shuffle_buffer_size` (Energon's sample shuffle buffer; None: none) and `shuffle` (False
    also keeps shard order: no shuffling at all). The arguments after it are the run's.
    """

    def __init__(
        self,
        encoder,
        d: DataConfig,
        *,
        seed: int,
        pad_token_id: int,
        spatial_merge_size: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        report_skips: bool = True,
    ):
        if d.source != "energon":
            raise ValueError(f"EnergonLoader reads data.source=energon, got {d.source}")
        self.path = validate_dataset_folder(d.path)
        self.task_encoder = QwenVLTaskEncoder(encoder, d, seed=seed, pad_token_id=pad_token_id,
                                              spatial_merge_size=spatial_merge_size)
        self.worker_config = energon_worker_config(
            d.num_workers, rank=rank, world_size=world_size, group=group, seed=seed
        )
        self.packing_buffer_size = d.packing_buffer_size or d.buffer_size
        self._warn_buffer_over_share(self.packing_buffer_size)
        self.shuffle, self.shuffle_buffer_size = d.shuffle, d.shuffle_buffer_size
        self._limits = BadLimits.of(d)
        self._energon: Any = None
        self._tally = Tally()
        self._report_skips = report_skips
        self._examples: dict[str, str] = {}  # one skipped sample's message per reason
        self._reported: Counter = Counter()  # skips per reason at the last summary
        self._reported_at = time.monotonic()

    def _warn_buffer_over_share(self, buffer: int) -> None:
        """Energon's buffers run across epochs: one larger than a worker's share of the
        dataset holds some samples twice (maybe in the same row)."""
        try:
            info = json.loads((self.path / ".nv-meta" / ".info.json").read_text())
            total = sum(info["shard_counts"].values())
        except (OSError, ValueError, KeyError, TypeError):
            return
        wc = self.worker_config
        share = total // (wc.world_size * max(wc.num_workers, 1))
        if buffer > share:
            log.warning(
                "data.packing_buffer_size=%d exceeds each worker's share of the dataset (%d of "
                "%d samples over %d rank(s) × %d worker(s)): a buffer will hold some samples "
                "twice; lower data.packing_buffer_size to at most %d", buffer, share, total,
                wc.world_size, max(wc.num_workers, 1), share,
            )

    def _loader(self):
        """Energon's savable loader, built on first use (restoring needs a fresh, unstarted one)."""
        if self._energon is None:
            # Energon re-reads the metadata here: check it again just before.
            validate_dataset_folder(self.path)
            dataset = get_train_dataset(
                str(self.path), worker_config=self.worker_config, batch_size=1,
                packing_buffer_size=self.packing_buffer_size,
                shuffle_buffer_size=self.shuffle_buffer_size, max_samples_per_sequence=None,
                shuffle_over_epochs_multiplier=1 if self.shuffle else None,
                task_encoder=self.task_encoder,
                # Without shuffling Energon reads one shard at a time, in order (it requires it).
                **({} if self.shuffle else {"parallel_shard_iters": 1}),
            )
            self._energon = get_savable_loader(dataset, watchdog_timeout_seconds=None)
        return self._energon

    def __iter__(self) -> Iterator[ThdBatch]:
        for row in self._loader():
            self._add(row)
            self._check_bad_fraction()
            if not row.filler:
                yield row.batch

    def _add(self, row: PackedRow) -> None:
        """Tally a row (Energon's epochs are not visible here: everything counts as epoch 0)."""
        self._tally.add(0, PACKED, row.packed)
        self._tally.add(0, TRUNCATED, row.truncated)
        for reason, n in row.skipped.items():
            self._tally.add(0, reason, n)
        for reason, message in row.examples.items():
            self._examples.setdefault(reason, message)
        if row.skipped and time.monotonic() - self._reported_at > SKIP_SUMMARY_S:
            self.summarize_skips()

    def summarize_skips(self) -> None:
        """Log one line per skip reason with samples skipped since the last summary: the count
        so far and one skipped sample's message (the trainer calls it at the end of training;
        the loader also every `SKIP_SUMMARY_S` seconds while skips come)."""
        self._reported_at = time.monotonic()
        counts = self._tally.as_dict()["skipped"]
        wc = self.worker_config
        prefix = f"rank {wc.rank}: " if wc.world_size > 1 else ""
        for reason, n in counts.items():
            if n > self._reported[reason] and self._report_skips:
                log.warning("%sskipped %d sample(s) so far (%s), e.g. %s", prefix, n, reason,
                            printable(self._examples.get(reason, "(not named)")))
            self._reported[reason] = n

    def _check_bad_fraction(self) -> None:
        acc = self.accounting
        self._limits.check_fraction(acc["samples"], acc["skipped"])

    @property
    def accounting(self) -> dict:
        """This rank's rows read so far: packed, truncated, skipped by reason (`Tally`)."""
        return self._tally.as_dict()

    @property
    def tally(self) -> Tally:
        return self._tally

    def state_dict(self) -> dict[str, Any]:
        """Energon's state of this rank (all workers) as `torch.save` bytes, and the accounting:
        `load_state_dict` reads the bytes with `weights_only=True`, allowing Energon's state
        dataclasses only (`_load_energon_state`)."""
        buf = io.BytesIO()
        torch.save(self._loader().save_state_rank(), buf, pickle_module=_EnergonPickle)
        return {"energon": buf.getvalue(), "tally": self._tally.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved (on a loader built with the same options)."""
        self.close()
        saved = state["energon"]
        self._loader().restore_state_rank(
            _load_energon_state(saved) if isinstance(saved, bytes) else saved)
        self._tally = Tally.from_state(state["tally"])
        self._reported = Counter(self._tally.as_dict()["skipped"])  # named by the earlier run

    def close(self) -> None:
        """Stop Energon's worker processes now (otherwise each one costs a 5 s join timeout
        when the loader is collected)."""
        it = getattr(getattr(self, "_energon", None), "_epoch_iterator", None)
        if it is not None:
            it.close()
        self._energon = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn things down
            self.close()
