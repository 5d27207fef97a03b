"""Models: presets, building, packed forward, varlen attention, GDN, MoE statistics, loss.

The names below are imported on first use, so a light submodule (`vlpack.model.presets`, which
`vlpack train --help` lists) loads without torch and transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlpack.model.build import ModelSpec, build_model
    from vlpack.model.forward import ForwardOut, packed_forward, unpacked_forward

_HOMES = {"ModelSpec": "build", "build_model": "build", "ForwardOut": "forward",
          "packed_forward": "forward", "unpacked_forward": "forward"}

__all__ = ["ForwardOut", "ModelSpec", "build_model", "packed_forward", "unpacked_forward"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
