"""`reference.stock_reference`: the check's reference runs transformers' own code and kernels."""

from __future__ import annotations

import copy
import importlib.util
import sys
import types

import torch

from vlpack.model import build_model, torch_kernels
from vlpack.model.forward import unpacked_forward
from vlpack.model.gdn import GatedDeltaNet
from vlpack.model.reference import stock_reference
from vlpack.model.synthetic import default_mix


def _logits(model, spec, sample) -> torch.Tensor:
    with torch.no_grad():
        return unpacked_forward(model, sample, spec=spec, hf_labels=True).logits.float()


def _recording_packages(looked: list[str]) -> dict[str, types.ModuleType]:
    """Stand-ins for fla and causal-conv1d, importable on the CPU: any name looked up in them
    is recorded (and missing, so an import that finds them falls back to torch)."""
    fakes = {}
    for name in ("fla", "causal_conv1d"):
        fake = types.ModuleType(name)

        def lookup(attr: str, package: str = name):
            looked.append(f"{package}.{attr}")
            raise AttributeError(attr)

        fake.__getattr__ = lookup
        fakes[name] = fake
    return fakes


def _executed_again(module: types.ModuleType, alias: str) -> types.ModuleType:
    """`module` executed once more from its file, as a fresh import would."""
    spec = importlib.util.spec_from_file_location(alias, module.__file__)
    again = importlib.util.module_from_spec(spec)
    sys.modules[alias] = again
    try:
        spec.loader.exec_module(again)
    finally:
        del sys.modules[alias]
    return again


def test_reference_runs_torch_kernels_without_touching_transformers(monkeypatch):
    """fla and causal-conv1d importable (simulated on the CPU by modules that record what is
    looked up in them): a fresh import of transformers' Qwen3.5 modeling module looks for their
    kernels, the reference's copy of it does not (they cannot be imported while it runs). Inside
    `stock_reference` the Gated-DeltaNet layers are of that copy's class and give bit for bit
    the logits of the stock forward; not one name of transformers' module changes and the
    packages are importable again after."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as stock_mod

    model, spec = build_model("tiny-qwen3_5", backend="sdpa", device="cpu", dtype=torch.float32)
    sample = default_mix(spec, 2, seed=0)[1]  # text only: the GDN layers are what matter
    stock = copy.deepcopy(model)  # every module of its stock class: transformers alone
    for m in stock.modules():
        m.__class__ = getattr(type(m), "_vlpack_stock", type(m))
    without_fla = _logits(stock, spec, sample)

    looked: list[str] = []
    fakes = _recording_packages(looked)
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    _executed_again(stock_mod, "transformers.models.qwen3_5._test_fresh_import")
    assert any(k.startswith("fla.") for k in looked)  # a fresh import would pick fla
    looked.clear()
    torch_kernels.torch_kernel_module.cache_clear()  # the copy is made while the fakes are there
    names = dict(vars(stock_mod))
    frozen = [p for n, p in model.named_parameters() if "linear_attn.in_proj" in n]
    for p in frozen:  # a frozen part stays frozen inside the block and after it
        p.requires_grad_(False)
    params = [id(p) for p in model.parameters()]
    ours = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert ours
    with stock_reference(model):
        assert looked == []
        assert [id(p) for p in model.parameters()] == params  # gradients land on the model's
        assert frozen and not any(p.requires_grad for p in frozen)
        layers = [m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
        copy_mod = torch_kernels.torch_kernel_module(stock_mod.__name__)
        assert layers and all(type(m) is copy_mod.Qwen3_5GatedDeltaNet for m in layers)
        assert copy_mod is not stock_mod
        assert all(vars(stock_mod)[k] is v for k, v in names.items())
        assert torch.equal(_logits(model, spec, sample), without_fla)
    assert vars(stock_mod) == names
    assert [m for m in model.modules() if isinstance(m, GatedDeltaNet)] == ours  # put back
    assert not any(p.requires_grad for p in frozen)
    assert all(sys.modules[name] is module for name, module in fakes.items())
    torch_kernels.torch_kernel_module.cache_clear()  # no later test gets a copy made beside fakes


def test_reference_keeps_lora_on_gated_deltanet():
    """A LoRA model's Gated-DeltaNet projections are peft wrappers: the reference layer holds
    the model's own submodules, so its forward runs them (an adapter with B ≠ 0 moves its
    logits exactly as it moves the vlpack model's stock forward) and their gradients land on
    the model's adapter parameters."""
    from vlpack.config import LoraConfig
    from vlpack.model.lora import apply_lora

    model, spec = build_model("tiny-qwen3_5", backend="sdpa", device="cpu", dtype=torch.float32)
    apply_lora(model, LoraConfig(rank=4, alpha=8, target_modules=["in_proj_qkv", "out_proj"]))
    adapters = [p for n, p in model.named_parameters() if "linear_attn" in n and "lora_B" in n]
    assert adapters
    with torch.no_grad():
        for p in adapters:
            p.normal_(0, 0.5)
    sample = default_mix(spec, 2, seed=0)[1]
    ours = _logits(model, spec, sample)
    with stock_reference(model):
        assert torch.allclose(_logits(model, spec, sample), ours, atol=1e-5, rtol=1e-5)
        out = unpacked_forward(model, sample, spec=spec, hf_labels=True)
        out.hf_loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters)
