"""What a checkpoint may unpickle: vlpack reads a rank's trainer state (and an Energon loader's
state inside it) with `torch.load(weights_only=True)`, which builds tensors, numbers and
containers and refuses every other global; these are the few it allows beside them."""

from __future__ import annotations

import pickle
import re
from typing import Any

import numpy as np
import torch


def numpy_array_globals() -> list:
    """What pickles a plain numpy array (an RNG key, Energon's sample indices)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, *{type(np.dtype(t)) for t in "?bBhHiIlLqQefdg"}]


def load_weights_only(source: Any, allowed: list | tuple = ()) -> tuple[Any, str | None]:
    """`torch.load(source, weights_only=True)` with plain numpy arrays and `allowed` beside
    tensors, numbers and containers: (the object, None), or (None, the global the pickle asks
    for and is refused; "" when the refusal names none). Nothing it names is run."""
    try:
        with torch.serialization.safe_globals([*numpy_array_globals(), *allowed]):
            return torch.load(source, weights_only=True), None
    except pickle.UnpicklingError as e:
        why = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        return None, why.group(1) if why else ""
