"""Which samples go into bins: one policy for the JSONL stream and the Energon task encoder.

`Admission.judge` applies the overlong policy (`data.overlong`) to a sample's size;
`BadLimits` decides when skipped samples mean a broken dataset rather than a noisy one
(`data.max_consecutive_bad`, `data.max_bad_fraction`). Both raise `DataLimitError`, a
ValueError whose message names the sample or the counts and the option that changes the outcome;
the Energon path re-raises it as Energon's fatal error so that Energon does not skip it.
Where each sample went is counted by `accounting.Tally`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from vlpack.config import DataConfig, Overlong
from vlpack.data.types import printable

PACK, TRUNCATE, SKIP = "pack", "truncate", "skip"
MIN_SEEN = 100
"""Samples seen before max_bad_fraction applies (all of them, for a smaller dataset)."""


class DataLimitError(ValueError):
    """The data breaks a limit the run was given: stop, with the numbers and the option."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The overlong policy: `error` (refuse the run), `truncate` (text-only cut) or `skip`."""

    seq_len: int
    max_patches: int | None
    overlong: Overlong

    @classmethod
    def of(cls, d: DataConfig) -> Admission:
        """The policy of `data.seq_len`, `data.max_patches` and `data.overlong`."""
        return cls(d.seq_len, d.max_patches, d.overlong)

    def __post_init__(self) -> None:
        if self.overlong not in get_args(Overlong):
            raise ValueError(f"data.overlong={self.overlong!r} is not one of "
                             f"{', '.join(get_args(Overlong))}")

    def judge(self, name: str, tokens: int, patches: int) -> tuple[str, str]:
        """(PACK | TRUNCATE | SKIP, why) for a sample of `tokens` tokens and `patches` ViT
        patches; DataLimitError under the `error` policy. Too many patches cannot be cut away
        (a cut never splits an image), so such a sample is skipped under `truncate` too."""
        too_many_patches = self.max_patches is not None and patches > self.max_patches
        if tokens <= self.seq_len and not too_many_patches:
            return PACK, ""
        what = (f"{tokens} tokens > seq_len {self.seq_len}" if tokens > self.seq_len
                else f"{patches} ViT patches > max_patches {self.max_patches}")  # fmt: skip
        if self.overlong == "error":
            raise DataLimitError(
                f"{printable(name)} is overlong ({what}); raise the sequence length / patch budget "
                "(data.seq_len, data.max_patches; `vlpack pack --seq-len`), or choose the overlong "
                "policy truncate (text-only cut) or skip (data.overlong=truncate|skip; "
                "`vlpack pack --overlong`)"
            )
        if self.overlong == "skip" or too_many_patches:
            return SKIP, f"{name}: overlong ({what})"
        return TRUNCATE, what


@dataclass(slots=True)
class BadLimits:
    """Fail after `max_consecutive_bad` skipped samples in a row, or when more than
    `max_bad_fraction` of the samples seen were skipped (judged from MIN_SEEN samples on, or
    once all `dataset_size` samples were seen when there are fewer). None: no such limit."""

    max_consecutive_bad: int | None
    max_bad_fraction: float | None
    dataset_size: int | None = None
    """Samples in the dataset, where known (the JSONL path); None: judged from MIN_SEEN on."""
    _run: int = field(default=0, init=False)

    @classmethod
    def of(cls, d: DataConfig, dataset_size: int | None = None) -> BadLimits:
        """The limits `data.max_consecutive_bad` and `data.max_bad_fraction`."""
        return cls(d.max_consecutive_bad, d.max_bad_fraction, dataset_size)

    def bad(self, reason: str, message: str, skipped: dict[str, int]) -> None:
        """A skipped sample; `skipped`: the skips so far by reason (this one included)."""
        self._run += 1
        if self.max_consecutive_bad is not None and self._run > self.max_consecutive_bad:
            raise DataLimitError(
                f"{self._run} bad samples in a row (last: {reason}: {printable(message)}); "
                "skipped so far: "
                f"{dict(skipped)}. Fix the data, or raise data.max_consecutive_bad"
            )

    def good(self) -> None:
        self._run = 0

    def check_fraction(self, seen: int, skipped: dict[str, int]) -> None:
        """DataLimitError when too large a share of the `seen` samples was skipped."""
        total = sum(skipped.values())
        floor = MIN_SEEN if self.dataset_size is None else min(MIN_SEEN, self.dataset_size)
        if self.max_bad_fraction is not None and seen >= floor and \
                total > self.max_bad_fraction * seen:
            raise DataLimitError(
                f"{total} of {seen} samples were skipped ({dict(skipped)}), more than "
                f"data.max_bad_fraction={self.max_bad_fraction}. Fix the data (`vlpack data "
                "validate` lists the bad samples) or raise the limit"
            )
