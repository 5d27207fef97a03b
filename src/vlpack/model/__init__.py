"""Models: presets, building, packed forward, varlen attention, GDN, MoE statistics, loss."""

from vlpack.model.build import ModelSpec, build_model
from vlpack.model.forward import ForwardOut, packed_forward, unpacked_forward

__all__ = ["ForwardOut", "ModelSpec", "build_model", "packed_forward", "unpacked_forward"]
