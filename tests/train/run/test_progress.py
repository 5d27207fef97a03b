"""The live view (train/run/progress.py): plain lines when stderr is not a terminal, the messages
around evaluations and saves, the ETA, and which messages show at which log level."""

from __future__ import annotations

import io
import logging
import re

import pytest

from vlpack.train.run.progress import Eta, Progress, clock, format_line, setup_logging

ROW = {"step": 12, "loss": 2.34564, "aux_loss": None, "lr": 1e-4, "grad_norm": 0.87,
       "tokens_per_s": 1234.4, "packing_efficiency": 0.934, "peak_mem_gib": 12.34,
       "peak_reserved_gib": 14.0, "epoch": 0.4112, "tokens_seen": 45678, "elapsed_s": 62.2,
       "eta_s": 150.0}


def test_plain_line_literal() -> None:
    assert format_line(ROW, 40) == (
        "vlpack: step 12/40 loss 2.3456 lr 1.00e-04 grad 0.870 tok/s 1,234 eff 93% "
        "mem 12.3/14.0 GiB epoch 0.41 tokens 45,678 elapsed 0:01:02 eta 0:02:30")
    cpu = {**ROW, "aux_loss": 0.0123, "peak_mem_gib": None, "peak_reserved_gib": None,
           "epoch": None, "eta_s": None}
    assert format_line(cpu, 40) == (
        "vlpack: step 12/40 loss 2.3456 aux 0.0123 lr 1.00e-04 grad 0.870 tok/s 1,234 eff 93% "
        "tokens 45,678 elapsed 0:01:02 eta ?")


def test_clock() -> None:
    assert [clock(s) for s in (0, 59.6, 3600 * 2 + 61, None)] == ["0:00:00", "0:01:00", "2:01:01", "?"]


def test_not_a_terminal_gets_one_plain_line_per_logged_step() -> None:
    """Under SLURM-style redirection: whole lines on the logged steps, no carriage returns."""
    out = io.StringIO()
    p = Progress(total=40, initial=10, log_every=2, enabled=True, stream=out)
    for step in (11, 12, 13, 14):
        p.step({**ROW, "step": step})
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    assert text.splitlines() == [format_line({**ROW, "step": s}, 40) for s in (12, 14)]


def test_disabled_view_prints_nothing() -> None:
    out = io.StringIO()
    p = Progress(total=4, initial=0, log_every=1, enabled=False, stream=out)
    p.step({**ROW, "step": 1})
    with p.phase("saving step 1", "saved step 1"):
        pass
    p.close()
    assert out.getvalue() == ""


@pytest.mark.parametrize("terminal", [False, True])
def test_phase_names_the_work_and_its_duration(terminal: bool) -> None:
    out = io.StringIO()
    p = Progress(total=4, initial=0, log_every=1, enabled=True, stream=out, terminal=terminal)
    with p.phase("evaluating step 2", "evaluated step 2") as done:
        assert p.bar.desc == "evaluating" or not terminal
        done["detail"] = ": eval loss 1.2500"
    assert p.bar.desc == "train" or not terminal
    p.close()
    lines = [x for x in out.getvalue().replace("\r", "\n").splitlines() if x.startswith("vlpack")]
    assert lines[0] == "vlpack: evaluating step 2…"
    assert re.fullmatch(r"vlpack: evaluated step 2 in \d+\.\d s: eval loss 1\.2500", lines[1]), lines
    assert done["seconds"] >= 0


def test_terminal_bar_shows_each_steps_own_loss() -> None:
    """The bar draws on update(): the step's loss must be set before it, not after (the bar
    showed the previous step's loss)."""
    drawn = []

    class Bar:
        def __init__(self):
            self.postfix = {}

        def set_postfix(self, refresh=True, **kw):
            self.postfix = kw

        def update(self, n):
            drawn.append(self.postfix.get("loss"))

    p = Progress(total=4, initial=0, log_every=1, enabled=True, stream=io.StringIO(), terminal=True)
    p.bar = Bar()
    for step, loss in ((1, 2.5), (2, 1.25)):
        p.step({**ROW, "step": step, "loss": loss})
    assert drawn == ["2.5000", "1.2500"]


def test_eta_from_the_steps_after_the_first() -> None:
    eta = Eta(first_step=4, total=20)
    assert eta.update(5, now=100.0) is None  # the first step pays for warm-up: not counted
    assert eta.update(7, now=110.0) == pytest.approx(5.0 * 13)
    assert eta.update(10, now=120.0) == pytest.approx(4.0 * 10)


@pytest.mark.parametrize(("rank", "level", "quiet", "expected"), [
    ("0", None, False, logging.INFO), ("0", None, True, logging.WARNING),
    ("0", "debug", False, logging.DEBUG), ("1", None, False, logging.WARNING),
])
def test_rank_zero_shows_info_unless_quiet(monkeypatch, rank, level, quiet, expected) -> None:
    monkeypatch.setenv("RANK", rank)
    logger = logging.getLogger("vlpack")
    old = logger.level
    try:
        assert setup_logging(level, quiet=quiet) == expected
        assert logging.getLogger("vlpack.data.setup").getEffectiveLevel() == expected
    finally:
        logger.setLevel(old)


def test_train_flags_anywhere_on_the_command_line() -> None:
    from vlpack.cli import _train_flags_first, build_parser

    argv = ["train", "tiny", "train.seed=1", "--log-level", "debug", "--quiet", "train.max_steps=2"]
    args = build_parser().parse_args(_train_flags_first(argv))
    assert (args.config, args.overrides, args.log_level, args.quiet) == (
        "tiny", ["train.seed=1", "train.max_steps=2"], "debug", True)
