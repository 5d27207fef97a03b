"""`vlpack check`'s vision-feature comparison and its position self-test (check/vision.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vlpack.check import vision as cv
from vlpack.cli import main
from vlpack.data.types import TOKEN_TYPE_IMAGE, TOKEN_TYPE_VIDEO
from vlpack.model.bounds import StaleVisionTablesError
from vlpack.model.synthetic import default_mix
from vlpack.model.vision import VisionTower, attend_row, vision_tables

VISION_PRESETS = ["tiny-qwen2_vl", "tiny-qwen2_5_vl", "tiny-qwen3_vl", "tiny-qwen3_5"]


def _model(name: str):
    from vlpack.check.command import check_config
    from vlpack.train.setup.stack import build_check_model

    torch.manual_seed(0)
    return build_check_model(check_config(name, dtype="float32"), torch.device("cpu"))


def test_reference_items_put_a_samples_videos_back_in_its_order():
    """transformers encodes a sample's images, then its videos: the items go back to the
    sample's own order (video, image, video here)."""
    class S:
        visual_kinds = np.array([TOKEN_TYPE_VIDEO, TOKEN_TYPE_IMAGE, TOKEN_TYPE_VIDEO])

    img, v0, v1 = (torch.full((1, 2), float(i)) for i in range(3))
    calls = [(None, [img]), (None, [v0, v1])]
    assert [float(x[0, 0]) for x in cv.reference_items(calls, S())] == [1.0, 0.0, 2.0]


def test_relative_diff_and_the_per_sample_worst():
    a = torch.ones(4, 3)
    assert cv.relative_diff(a, a) == 0.0
    assert cv.relative_diff(a[:2], a) == float("inf") and cv.relative_diff(None, a) == float("inf")
    b = a.clone()
    b[0, 0] = 1.5
    assert cv.compare_items([[a, b], []], [[a, a], []]) == [pytest.approx(0.5 / 12**0.5), 0.0]
    assert cv.compare_items([[a]], [[a, a]]) == [float("inf")]


def test_a_weak_self_test_fails_loudly():
    assert cv.sensitivity_failures({}) == []
    assert cv.sensitivity_failures({"zeroed": 1.0, "min": 1.0}) == []
    weak = {"zeroed": 1e-3, "h and w swapped": 1e-9, "min": 1e-9}
    (line,) = cv.sensitivity_failures(weak)
    assert "h and w swapped" in line and "cannot see a vision position error" in line


@pytest.mark.parametrize("name", VISION_PRESETS)
def test_the_self_test_sees_a_vision_position_error_on_every_family(name):
    """On the check's default samples a wrong vision rotary position moves the tower's
    features by at least `SENSITIVITY` x the tolerance on every family's tiny preset."""
    model, spec = _model(name)
    sens = cv.position_sensitivity(model, default_mix(spec, 4), spec.merge_size)
    assert sens["min"] >= cv.SENSITIVITY * cv.VISION_TOL, sens


def test_stale_vlpack_boundaries_are_named_as_vlpacks():
    """A vision block handed boundaries of another row (tables vlpack kept from an earlier
    forward) raises `StaleVisionTablesError` (a vlpack bug, the check's exit 1); a tensor of
    this row's values that vlpack did not build (a tower computing its own) is the
    unsupported-transformers error (exit 2)."""
    from vlpack.model.bounds import Boundaries

    model, spec = _model("tiny-qwen2_5_vl")
    tower, cpu = model.model.visual, torch.device("cpu")
    first = vision_tables(tower, spec.family, ((1, 16, 16),), cpu)
    now = vision_tables(tower, spec.family, ((1, 8, 8), (1, 16, 16)), cpu)
    bounds = Boundaries(None, now)
    q = torch.zeros(now.full.host[-1], 2, 4)
    with pytest.raises(StaleVisionTablesError, match="not this row's"):
        attend_row("sdpa", q, q, q, bounds, first.window.cu, 1.0)
    with pytest.raises(ValueError, match="did not build"):
        attend_row("sdpa", q, q, q, bounds, now.full.cu.clone(), 1.0)


def test_stale_vision_rotary_tables_fail_the_check(monkeypatch, capsys):
    """The rotary positions of the first packed forward reused by every later one: the logits
    move by less than their tolerance on this tiny model, the vision features by far more."""
    orig = VisionTower.forward

    def stale(self, hidden_states, grid_thw=None, **kwargs):
        bounds = kwargs.get("vlpack_bounds")
        if bounds is not None and bounds.vision is not None:
            pos = self.__dict__.setdefault("_first", bounds.vision.tables["position_ids"])
            bounds.vision.tables["position_ids"] = pos
        return orig(self, hidden_states, grid_thw, **kwargs)

    monkeypatch.setattr(VisionTower, "forward", stale)
    assert main(["check", "--model", "tiny-qwen2_vl", "--samples", "3", "--json"]) == 1
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lines = [f for f in r["failures"] if "vision features" in f]
    assert lines and all("second bin" in f for f in lines), r["failures"]
    assert r["second_bin"]["max_vision_diff"] >= 10 * cv.VISION_TOL
