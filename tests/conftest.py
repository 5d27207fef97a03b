"""Test-session settings: vlpack's on-disk caches (sizes, synthetic data) live in a folder of
this session, not in the user's `~/.cache/vlpack`."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config) -> None:
    os.environ["VLPACK_CACHE"] = tempfile.mkdtemp(prefix="vlpack-test-cache-")
