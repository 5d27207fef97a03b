"""The live view of a run on rank 0: a tqdm bar on a terminal, else one plain line every
`train.log_every` steps (a log file under SLURM-style redirection gets readable lines, not one
line of carriage-return redraws), and a line before and after each evaluation and save.

A plain line (`format_line`), with every figure the metrics row has::

    vlpack: step 12/40 loss 2.3456 lr 1.00e-04 grad 0.870 tok/s 1,234 eff 93% \
mem 12.3/14.0 GiB epoch 0.41 tokens 45,678 elapsed 0:01:02 eta 0:02:30
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from tqdm.auto import tqdm


def clock(seconds: float | None) -> str:
    """Seconds as H:MM:SS (`?` when unknown)."""
    if seconds is None:
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_line(row: dict[str, Any], total: int) -> str:
    """One plain progress line for a metrics row (keys that are None or absent are left out)."""
    parts = [f"step {row['step']}/{total}", f"loss {row['loss']:.4f}"]
    if row.get("aux_loss") is not None:
        parts.append(f"aux {row['aux_loss']:.4f}")
    parts += [f"lr {row['lr']:.2e}", f"grad {row['grad_norm']:.3f}",
              f"tok/s {row['tokens_per_s']:,.0f}", f"eff {100 * row['packing_efficiency']:.0f}%"]
    if row.get("peak_mem_gib") is not None:
        parts.append(f"mem {row['peak_mem_gib']:.1f}/{row['peak_reserved_gib']:.1f} GiB")
    if row.get("epoch") is not None:
        parts.append(f"epoch {row['epoch']:.2f}")
    parts += [f"tokens {row['tokens_seen']:,}", f"elapsed {clock(row['elapsed_s'])}",
              f"eta {clock(row['eta_s'])}"]
    return "vlpack: " + " ".join(parts)


class Eta:
    """Time left: the mean wall time of this process's steps after its first (which also pays
    for warm-up and compilation), times the steps left; None until two steps have run."""

    def __init__(self, first_step: int, total: int) -> None:
        self.first_step, self.total = first_step, total
        self.start: float | None = None  # when the first step of this process ended
        self.start_step = first_step

    def update(self, step: int, now: float | None = None) -> float | None:
        """Record that `step` ended at `now` (time.monotonic()); return the seconds left."""
        now = time.monotonic() if now is None else now
        if self.start is None:
            self.start, self.start_step = now, step
            return None
        per_step = (now - self.start) / (step - self.start_step)
        return per_step * (self.total - step)


class Progress:
    """Rank 0's live view; every method is a no-op on other ranks and with `enabled=False`."""

    def __init__(self, *, total: int, initial: int, log_every: int, enabled: bool,
                 stream: TextIO | None = None, terminal: bool | None = None) -> None:
        self.total, self.log_every, self.enabled = total, log_every, enabled
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=self.stream,
                        disable=not (enabled and self.terminal), dynamic_ncols=True)

    def say(self, text: str) -> None:
        """One line (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.terminal:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def step(self, row: dict[str, Any]) -> None:
        """Show a finished step: the bar's postfix, or a plain line on logged steps."""
        if not self.enabled:
            return
        if self.terminal:  # the postfix first: update() draws the bar with this step's loss
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                 eff=f"{100 * row['packing_efficiency']:.0f}%", refresh=False)
            self.bar.update(1)
        elif row["step"] % self.log_every == 0:
            print(format_line(row, self.total), file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, doing: str, done: str) -> Iterator[dict[str, Any]]:
        """`vlpack: {doing}…` before the work and `vlpack: {done} in S s` after it; the bar's
        label names the work meanwhile. The caller may add `detail` to the yielded dict."""
        self.bar.set_description_str(doing.split()[0])
        self.say(f"vlpack: {doing}…")
        t0 = time.perf_counter()
        out: dict[str, Any] = {"detail": ""}
        try:
            yield out
        finally:
            out["seconds"] = time.perf_counter() - t0
            self.bar.set_description_str("train")
        self.say(f"vlpack: {done} in {out['seconds']:.1f} s{out['detail']}")

    def close(self) -> None:
        self.bar.close()


def setup_logging(level: str | None = None, *, quiet: bool = False) -> int:
    """Show vlpack's messages on stderr: INFO and above on rank 0 (`level` or `quiet` lower or
    raise that), WARNING and above on the other ranks (torchrun's RANK); other libraries'
    loggers stay at WARNING. Returns the level set for vlpack."""
    main = int(os.environ.get("RANK", "0")) == 0
    name = "warning" if quiet or not main else (level or "info")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    value = getattr(logging, name.upper())
    logging.getLogger("vlpack").setLevel(value)
    return value
