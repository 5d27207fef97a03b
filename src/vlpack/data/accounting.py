"""Where every sample went, epoch by epoch: packed, truncated (and packed), or skipped by reason.

A sample is counted by the rank that consumes the bin it rides on: a trained sample in its own
bin, a sample skipped while planning in the next bin the stream emits after it (`PlannedBin
.skips`), a sample that fails to encode in the bin it was planned into. Every rank plans the same
global stream and each bin goes to one rank, so the tallies of all ranks, added up
(`Tally.merged`), count each sample of an epoch exactly once. Samples planned ahead but not yet
consumed are not counted.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from vlpack.data.types import printable

log = logging.getLogger("vlpack.data")

PACKED, TRUNCATED = "packed", "truncated"
MAX_PRINTED = 20
"""Skips printed per rank; later ones are counted only (`vlpack data validate` lists them all)."""


@dataclass(frozen=True, slots=True)
class Skip:
    """One skipped sample of one epoch. `message` names the sample (its id or file:line)."""

    index: int
    epoch: int
    reason: str
    message: str


class Tally:
    """Per-epoch counts of one rank: `PACKED`, `TRUNCATED` and one key per skip reason; and,
    for a mixture (`data.mix`), the samples trained from each source."""

    def __init__(self, epochs: dict[int, Counter] | None = None,
                 sources: Counter | None = None) -> None:
        self.epochs: dict[int, Counter] = epochs or {}
        self.sources: Counter = sources or Counter()

    def add_source(self, name: str) -> None:
        """Count one trained (packed or truncated) sample of the mixture's source `name`."""
        self.sources[name] += 1

    def add(self, epoch: int, outcome: str, n: int = 1) -> None:
        """Count `n` samples of `epoch` as `outcome` (PACKED, TRUNCATED or a skip reason)."""
        if n:
            self.epochs.setdefault(epoch, Counter())[outcome] += n

    def as_dict(self) -> dict:
        """Totals over all epochs, and the same per epoch under "epochs" (JSON-ready)."""
        total: Counter = sum(self.epochs.values(), Counter())
        out = {**_summary(total),
               "epochs": {e: _summary(c) for e, c in sorted(self.epochs.items())}}  # fmt: skip
        if self.sources:
            out["sources"] = dict(sorted(self.sources.items()))
        return out

    def state(self) -> dict:
        """Plain data for a checkpoint (`Tally.from_state` restores it)."""
        out = {str(e): dict(c) for e, c in self.epochs.items()}
        return {**out, "sources": dict(self.sources)} if self.sources else out

    @classmethod
    def from_state(cls, state: dict) -> Tally:
        epochs = {int(e): Counter(c) for e, c in state.items() if e != "sources"}
        return cls(epochs, Counter(state.get("sources", {})))

    @classmethod
    def merged(cls, states: list[dict]) -> Tally:
        """The sum of several ranks' `state()`s."""
        out = cls()
        for s in states:
            one = cls.from_state(s)
            for e, c in one.epochs.items():
                out.epochs.setdefault(e, Counter()).update(c)
            out.sources.update(one.sources)
        return out


def _summary(c: Counter) -> dict:
    skipped = {k: v for k, v in sorted(c.items()) if k not in (PACKED, TRUNCATED)}
    return {"samples": sum(c.values()), "packed": c[PACKED], "truncated": c[TRUNCATED],
            "skipped": skipped}  # fmt: skip


class SkipReporter:
    """Prints each skip of the first epoch once (per rank, `MAX_PRINTED` at most); a skip of a
    later epoch repeats one already printed, so it is only counted."""

    def __init__(self, rank: int | None = None) -> None:
        self.prefix = f"rank {rank}: " if rank is not None else ""
        self.printed = 0

    def __call__(self, skip: Skip) -> None:
        if skip.epoch > 0 or self.printed > MAX_PRINTED:
            return
        self.printed += 1
        if self.printed > MAX_PRINTED:
            log.warning("%sfurther skipped samples are counted, not printed (`vlpack data "
                        "validate FILE` lists every bad sample)", self.prefix)
            return
        log.warning("%sskipping a sample (%s): %s", self.prefix, skip.reason,
                    printable(skip.message))
