"""What a checkpoint may unpickle: vlpack reads a rank's trainer state (and an Energon loader's
state inside it) with `torch.load(weights_only=True)`, which builds tensors, numbers and
containers and refuses every other global; these are the few it allows beside them."""

from __future__ import annotations

import numpy as np


def numpy_array_globals() -> list:
    """What pickles a plain numpy array (an RNG key, Energon's sample indices)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, *{type(np.dtype(t)) for t in "?bBhHiIlLqQefdg"}]
