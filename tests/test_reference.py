"""`reference.stock_reference`: the check's reference runs transformers' own code and kernels."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from vlpack.model import build_model
from vlpack.model.forward import unpacked_forward
from vlpack.model.reference import GDN_KERNELS, stock_reference
from vlpack.model.synthetic import default_mix


def _logits(model, spec, sample) -> torch.Tensor:
    with torch.no_grad():
        return unpacked_forward(model, sample, spec=spec, hf_labels=True).logits.float()


def test_reference_runs_torch_kernels_without_touching_transformers(monkeypatch):
    """fla "importable" (simulated on CPU: transformers' kernel wrappers of the Qwen3.5 modeling
    module call a kernel that refuses to run): inside `stock_reference` the Gated-DeltaNet
    layers run transformers' torch kernels, bit for bit the logits of the stock forward where
    fla is absent, and not one name of the modeling module is replaced."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as stock_mod

    model, spec = build_model("tiny-qwen3_5", backend="sdpa", device="cpu", dtype=torch.float32)
    sample = default_mix(spec, 2, seed=0)[1]  # text only: the GDN layers are what matter
    stock = copy.deepcopy(model)  # every module of its stock class: transformers alone
    for m in stock.modules():
        m.__class__ = getattr(type(m), "_vlpack_stock", type(m))
    without_fla = _logits(stock, spec, sample)

    def fla_kernel(*a, **k):
        raise AssertionError("an fla kernel ran on the CPU")

    for name in GDN_KERNELS:  # a kernel wrapper that calls "fla", over transformers' own
        wrapper = functools.wraps(getattr(stock_mod, name))(lambda *a, **k: fla_kernel())
        monkeypatch.setattr(stock_mod, name, wrapper)
    with pytest.raises(AssertionError, match="fla kernel"):  # the stock forward would call it
        _logits(model, spec, sample)
    names = dict(vars(stock_mod))
    with stock_reference(model):
        assert all(vars(stock_mod)[k] is v for k, v in names.items())
        assert torch.equal(_logits(model, spec, sample), without_fla)
    assert vars(stock_mod) == names
