"""GPU tests (skipped without CUDA): the memory plan's view of the device."""

from __future__ import annotations

import pytest
import torch

from vlpack.train.setup import memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_free_memory_of_a_device_named_without_an_index() -> None:
    """`torch.device("cuda")` (the bench's topology) reads the current device's free memory, as
    its index does; torch's per-process fraction refuses a device without an index."""
    here = torch.device("cuda", torch.cuda.current_device())
    bare, indexed = memory.available_bytes(torch.device("cuda")), memory.available_bytes(here)
    assert bare is not None and indexed is not None and abs(bare - indexed) < 2**30
