"""The deterministic bin stream: sample sizes in, this rank's bins out.

Everything here is a pure function of (sizes, config, seed): every rank computes the same global
stream of bins and takes its share, so no rank ever waits on another for data, and the stream
position is one integer. Resuming replays the planning (cheap: lengths only, no pixels) up to
that position, so a restored stream continues exactly.

Stages: epoch order (seeded shuffle) → skip bad / apply the overlong policy (every sample
counted) → online planner over a bounded buffer (carrying underfilled bins) → rounds of
world_size × micro_batches bins balanced by estimated compute → this rank's bins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from vlpack.config import DataConfig
from vlpack.data.accounting import Skip
from vlpack.data.admission import PACK, SKIP, Admission, BadLimits
from vlpack.data.plan import OnlinePlanner, assign_bins_to_ranks, estimate_bin_cost
from vlpack.data.types import BadSampleError, SampleSize

SizeOrError = SampleSize | BadSampleError
TruncateFn = Callable[[int, int], SampleSize]
"""(sample index, max tokens) → size after text-only truncation; raises BadSampleError."""


@dataclass(frozen=True, slots=True)
class PlannedBin:
    """One bin: dataset indices, and a token cap for samples that were truncated."""

    items: tuple[int, ...]
    truncate: tuple[tuple[int, int], ...] = ()
    """(dataset index, max tokens) of the samples that must be cut to fit."""
    lengths: tuple[int, ...] = ()
    """Real tokens of each item (after truncation)."""
    patches: int = 0
    epochs: tuple[int, ...] = ()
    """The epoch each item was drawn in (a carried item can share a bin with the next epoch)."""
    skips: tuple[Skip, ...] = ()
    """Samples skipped while planning since the previous bin of the stream, of this bin's
    epochs or earlier (see accounting.py)."""

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(slots=True)
class Accounting:
    """What the planner has seen so far (every rank alike, planned-ahead samples included):
    packed, truncated (and packed), or skipped with a reason. The per-rank, per-epoch count of
    what was trained is `accounting.Tally`."""

    seen: int = 0
    packed: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {
            "samples": self.seen,
            "packed": self.packed,
            "truncated": self.truncated,
            "skipped": dict(sorted(self.skipped.items())),
        }


class _FixedGroups:
    """The `none` planner: consecutive samples in groups of `size` (padded batches)."""

    def __init__(self, size: int):
        self.size, self.buf = size, []

    def push(self, item: int, tokens: int, patches: int = 0) -> list[list[int]]:
        self.buf.append(item)
        if len(self.buf) < self.size:
            return []
        out, self.buf = [self.buf], []
        return out

    def flush(self) -> list[list[int]]:
        out, self.buf = ([self.buf] if self.buf else []), []
        return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Sample order of one epoch: a seeded permutation (or identity)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass(kw_only=True)
class BinStream:
    """Global stream of bins over `sizes` (identical on every rank).

    `epochs=None` streams forever (epochs chained, the planner's carry flowing across epoch
    boundaries so nothing is dropped); otherwise the planner is flushed after the last epoch.
    """

    sizes: Sequence[SizeOrError]
    """Per-sample sizes; where they have `of_epoch(epoch)` (a mixture's `EntrySizes`), each
    epoch plans with that epoch's."""
    data: DataConfig
    """The packing settings: `packing` (a planner, or `none` for fixed groups of `batch_size`
    consecutive samples), seq_len, buffer_size, max_patches, pad_to_multiple_of, overlong,
    shuffle, and the bad-sample limits (admission.py)."""
    seed: int
    epochs: int | None
    truncate_fn: TruncateFn | None = None
    """The encoder's cut, needed by `data.overlong=truncate`."""
    describe: Callable[[int], str] | None = None
    """Name of sample i in messages (its id or file:line); default `sample #i+1` (1-based)."""
    account: Accounting = field(default_factory=Accounting)
    _admission: Admission = field(init=False, repr=False)
    _limits: BadLimits = field(init=False, repr=False)
    _epoch: int = field(default=0, init=False, repr=False)
    _sizes: Sequence[SizeOrError] = field(default=(), init=False, repr=False)
    _pending: list[Skip] = field(default_factory=list, init=False, repr=False)
    """Skips not yet attached to an emitted bin."""

    def __post_init__(self) -> None:
        self._admission = Admission.of(self.data)
        self._limits = BadLimits.of(self.data, len(self.sizes))
        self._sizes = self.sizes
        if self.data.overlong == "truncate" and self.truncate_fn is None:
            raise ValueError("overlong='truncate' needs a truncate_fn (the encoder's)")

    @property
    def epoch(self) -> int:
        """The epoch being planned."""
        return self._epoch

    def _name(self, i: int) -> str:
        return self.describe(i) if self.describe is not None else f"sample #{i + 1}"

    def _skip(self, i: int, reason: str, message: str) -> None:
        """Count a skipped sample; fail when the dataset looks broken rather than noisy."""
        self.account.skipped[reason] += 1
        self._pending.append(Skip(i, self._epoch, reason, message))
        self._limits.bad(reason, message, self.account.skipped)

    def _admit(self, i: int) -> tuple[SampleSize, int | None] | None:
        """Size to plan with and truncation cap, or None when the sample is skipped."""
        admitted = self._admit_one(i)
        self._limits.check_fraction(self.account.seen, self.account.skipped)
        return admitted

    def _admit_one(self, i: int) -> tuple[SampleSize, int | None] | None:
        size = self._sizes[i]
        self.account.seen += 1
        if isinstance(size, BadSampleError):
            self._skip(i, size.reason, str(size))
            return None
        cap = None
        verdict, why = self._admission.judge(self._name(i), size.tokens, size.patches)
        if verdict == SKIP:
            self._skip(i, "overlong", why)
            return None
        if verdict == PACK:
            self.account.packed += 1
        else:
            try:
                size = self.truncate_fn(i, self.data.seq_len)
            except BadSampleError as e:
                self._skip(i, e.reason, str(e))
                return None
            cap = size.tokens
            self.account.truncated += 1
        self._limits.good()
        return size, cap

    def __iter__(self) -> Iterator[PlannedBin]:
        d = self.data
        planner = (
            _FixedGroups(d.batch_size)
            if d.packing == "none"
            else OnlinePlanner(d.seq_len, d.packing, d.buffer_size, max_patches=d.max_patches,
                               seed=self.seed)
        )
        info: dict[int, tuple[SampleSize, int | None, int]] = {}

        def emit(bins: list[list[int]]) -> Iterator[PlannedBin]:
            for b in bins:
                entries = [info.pop(i) for i in b]
                # a bin carries the skips planned before it of its epochs, not those the
                # planner's look-ahead met in a later epoch (counted once that epoch trains)
                newest = max(e[2] for e in entries)
                skips = tuple(s for s in self._pending if s.epoch <= newest)
                self._pending = [s for s in self._pending if s.epoch > newest]
                yield PlannedBin(
                    items=tuple(b),
                    truncate=tuple((i, e[1]) for i, e in zip(b, entries, strict=True) if e[1]),
                    lengths=tuple(e[0].tokens for e in entries),
                    patches=sum(e[0].patches for e in entries),
                    epochs=tuple(e[2] for e in entries),
                    skips=skips,
                )

        epoch = self._epoch = 0
        while self.epochs is None or epoch < self.epochs:
            self._epoch = epoch
            of_epoch = getattr(self.sizes, "of_epoch", None)
            self._sizes = of_epoch(epoch) if of_epoch is not None else self.sizes
            for i in epoch_order(len(self.sizes), epoch, self.seed, d.shuffle).tolist():
                admitted = self._admit(i)
                if admitted is None:
                    continue
                if i in info:  # the same sample again while its previous copy is still buffered
                    yield from emit(planner.flush())
                info[i] = (*admitted, epoch)
                aligned = _round_up(admitted[0].tokens, d.pad_to_multiple_of)
                yield from emit(planner.push(i, aligned, admitted[0].patches))
            epoch += 1
            if self.epochs is None and self.account.seen and not (
                self.account.packed + self.account.truncated
            ):
                raise ValueError("every sample of the dataset was skipped: nothing to train on")
        yield from emit(planner.flush())


    @property
    def unattached_skips(self) -> tuple[Skip, ...]:
        """Skips after the last emitted bin (a finite stream's tail rides on no bin)."""
        return tuple(self._pending)


def rank_bins(
    stream: Iterator[PlannedBin], *, rank: int, world_size: int, per_round: int = 1
) -> Iterator[PlannedBin]:
    """This rank's share of a global bin stream: rounds of world_size × per_round bins,
    balanced by estimated compute, every rank getting per_round bins of each round.

    An incomplete final round (finite streams only: evaluation) is dropped on every rank
    alike, at most world_size × per_round − 1 bins; training streams are endless (epochs
    chained), so training never drops one.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    n = world_size * per_round
    round_: list[PlannedBin] = []
    for b in stream:
        round_.append(b)
        if len(round_) < n:
            continue
        if world_size == 1:
            yield from round_
        else:
            costs = [estimate_bin_cost(b.lengths, b.patches) for b in round_]
            for j in assign_bins_to_ranks(costs, world_size)[rank]:
                yield round_[j]
        round_ = []
