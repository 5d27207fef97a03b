"""The one admission policy: overlong samples and bad-sample limits, worked by hand."""

from __future__ import annotations

import pytest

from vlpack.config import DataConfig
from vlpack.data.admission import PACK, SKIP, TRUNCATE, Admission, BadLimits, DataLimitError


def test_overlong_policy_by_hand() -> None:
    a = Admission(seq_len=100, max_patches=50, overlong="truncate")
    assert a.judge("s", 100, 50) == (PACK, "")
    assert a.judge("s", 101, 10) == (TRUNCATE, "101 tokens > seq_len 100")
    # too many patches cannot be cut away: skipped even under truncate
    assert a.judge("s", 90, 51) == (SKIP, "s: overlong (51 ViT patches > max_patches 50)")
    assert Admission(100, None, "skip").judge("d.jsonl:3", 150, 0) == (
        SKIP, "d.jsonl:3: overlong (150 tokens > seq_len 100)")
    with pytest.raises(DataLimitError, match=r"^d\.jsonl:3 is overlong \(150 tokens > seq_len "
                                              r"100\).*data\.overlong=truncate\|skip"):
        Admission(100, None, "error").judge("d.jsonl:3", 150, 0)
    with pytest.raises(ValueError, match=r"^data\.overlong='drop' is not one of error, truncate, skip$"):
        Admission(100, None, "drop")


def test_bad_limits_by_hand() -> None:
    run = BadLimits(max_consecutive_bad=2, max_bad_fraction=None)
    run.bad("x", "a", {"x": 1})
    run.bad("x", "b", {"x": 2})
    run.good()  # a good sample ends the run
    run.bad("x", "c", {"x": 3})
    run.bad("x", "d", {"x": 4})
    with pytest.raises(DataLimitError, match=r"3 bad samples in a row \(last: x: e\).*"
                                             r"data\.max_consecutive_bad"):
        run.bad("x", "e", {"x": 5})
    share = BadLimits(None, max_bad_fraction=0.25, dataset_size=8)
    share.check_fraction(7, {"x": 7})  # fewer than all 8 of a tiny dataset: not judged yet
    share.check_fraction(8, {"x": 2})  # 2 of 8 = 0.25: not more than the limit
    with pytest.raises(DataLimitError, match=r"3 of 8 samples were skipped.*max_bad_fraction=0\.25"):
        share.check_fraction(8, {"x": 3})
    big = BadLimits(None, max_bad_fraction=0.25)  # size unknown (Energon): judged from 100 on
    big.check_fraction(99, {"x": 99})
    with pytest.raises(DataLimitError):
        big.check_fraction(100, {"x": 26})


def test_limits_are_read_from_the_data_section() -> None:
    d = DataConfig(seq_len=96, max_patches=40, overlong="skip", max_consecutive_bad=3,
                   max_bad_fraction=0.5)
    assert Admission.of(d) == Admission(96, 40, "skip")
    limits = BadLimits.of(d, dataset_size=7)
    assert (limits.max_consecutive_bad, limits.max_bad_fraction, limits.dataset_size) == (3, 0.5, 7)
    default = BadLimits.of(DataConfig())  # the config's defaults, the only ones
    assert (default.max_consecutive_bad, default.max_bad_fraction) == (32, 0.05)


def test_a_sample_name_cannot_forge_the_error_it_stops_the_run_with() -> None:
    """A sample's name (its id, from the data) reaches the terminal escaped: no control
    sequence, no new line that could pass for one of vlpack's."""
    forged = "x\x1b[31m\nvlpack: done"
    with pytest.raises(DataLimitError) as overlong:
        Admission(100, None, "error").judge(forged, 150, 0)
    run = BadLimits(max_consecutive_bad=0, max_bad_fraction=None)
    with pytest.raises(DataLimitError) as bad:
        run.bad("bad_json", f"{forged}: not JSON", {"bad_json": 1})
    for e in (overlong.value, bad.value):
        assert "\x1b" not in str(e) and "\n" not in str(e) and "x\\x1b[31m\\nvlpack" in str(e)
