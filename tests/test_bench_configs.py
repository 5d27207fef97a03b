"""The benches' configs load for every shipped recipe: the overrides a bench adds to a recipe
(bench/convergence.py's two modes, bench/divergence.py and bench/bf16_offset.py) pass the
config's own checks here, on the CPU, before a GPU call would find a refusal at start-up."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.helpers import bench_module

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "src" / "vlpack" / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def convergence():
    return bench_module("convergence")


def _args(recipe: str) -> argparse.Namespace:
    return argparse.Namespace(recipe=recipe, layers=None, samples=800, seq_len=4096, overrides=[])


@pytest.mark.parametrize("recipe", RECIPES)
def test_convergence_modes_load(convergence, recipe):
    """Both modes of the convergence bench (and the divergence and bf16-offset benches, which
    add their own overrides to its config) load for each packed recipe; the padded mode trains
    the trainer's padded path."""
    packed = convergence.bench_config(_args(recipe))
    if packed.data.packing == "none":
        pytest.skip("a padded recipe: the bench plans packed bins (convergence.plan refuses it)")
    padded = convergence.bench_config(_args(recipe), *convergence.padded_overrides(packed))
    assert padded.data.packing == "none"
    assert padded.data.seq_len == packed.data.seq_len == 4096
    convergence.bench_config(_args(recipe), "model.compile=false",
                             "data.mrope_after_video=transformers", "optim.grad_clip=0",
                             "train.max_steps=200")
