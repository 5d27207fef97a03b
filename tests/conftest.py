"""Test-session settings: vlpack's on-disk caches (sizes, synthetic data) live in a folder of
this session, not in the user's `~/.cache/vlpack`."""

from __future__ import annotations

import os
import tempfile

import pytest

from vlpack.config import VideoSettings
from vlpack.data.encode import Encoder
from vlpack.data.loader import open_dataset


def pytest_configure(config) -> None:
    os.environ["VLPACK_CACHE"] = tempfile.mkdtemp(prefix="vlpack-test-cache-")


@pytest.fixture(scope="module")
def samples():
    enc = Encoder("qwen3_vl", min_pixels=16384, max_pixels=50176,
                  video=VideoSettings(min_pixels=4096, max_pixels=50176))
    items = open_dataset("synthetic", None, synthetic_samples=24)
    return [enc.encode(c) for c in items[:15]]
