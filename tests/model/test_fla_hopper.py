"""fla's gated-delta-rule backward on Hopper (model/fla_hopper.py): the self-test, on CPU with
a stand-in for fla's kernel."""

from __future__ import annotations

import itertools
import typing

import pytest
import torch


def _stand_in_fla(monkeypatch, leaky: bool):
    """fla's varlen delta rule replaced by transformers' torch kernel (per segment, or across
    the boundaries when `leaky`), and vlpack's fla backend by a plain class."""
    import sys
    import types

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from vlpack.model import fla_hopper
    from vlpack.model.torch_kernels import torch_function

    raw = torch_function(m.Qwen3_5GatedDeltaNet, "torch_chunk_gated_delta_rule")

    def stand_in(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens):
        host = [0, q.shape[1]] if leaky else cu_seqlens.tolist()
        return torch.cat([raw(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
                          for s, e in itertools.pairwise(host)], dim=1), None

    ops = types.ModuleType("fla.ops.gated_delta_rule")
    ops.chunk_gated_delta_rule = stand_in
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", ops)

    class Backend:
        approved: typing.ClassVar[dict] = {}

    monkeypatch.setattr(fla_hopper, "_register", lambda: Backend)
    monkeypatch.setattr(fla_hopper, "fla_tiling", lambda K, V, index: (16, 16))
    return raw, Backend


def test_fla_self_test_inside_a_checkpointed_layer(monkeypatch):
    """The self-test runs in the first forward of a GDN layer, which activation checkpointing
    wraps: it runs once, and neither it nor the layer's backward trips the checkpoint."""
    from vlpack.model import fla_hopper

    raw, _ = _stand_in_fla(monkeypatch, leaky=False)
    calls = []

    def layer(x):
        calls.append(fla_hopper.self_test(16, 16, torch.device("cpu"), raw))
        return (x * 2).sin()

    x = torch.randn(4, 3, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    assert len(calls) == 1 and calls[0].ok, calls
    y.sum().backward()  # the layer is recomputed here (a second self-test, as the first)
    assert x.grad is not None and len(calls) == 2


@pytest.mark.parametrize("heads", [2, 5])
@pytest.mark.parametrize("leaky", [False, True])
def test_fla_self_test_approves_a_correct_kernel_and_refuses_a_leaky_one(monkeypatch, leaky, heads):
    """The self-test's judgement, on CPU with a stand-in for fla's kernel: one that restarts at
    the boundaries (the per-segment torch kernel) is approved; one that carries state across
    them is refused, with its errors, and leaves no approval behind. The row has the layer's
    head count (`heads`)."""
    from vlpack.model import fla_hopper

    raw, Backend = _stand_in_fla(monkeypatch, leaky)
    seen = []

    def counting(q, *args, **kwargs):
        seen.append(q.shape[2])
        return raw(q, *args, **kwargs)

    d = fla_hopper.self_test(16, 16, torch.device("cpu"), counting, heads=heads)
    assert seen and set(seen) == {heads}
    assert set(d.errors) == {"q", "k", "v", "g", "beta"}
    assert d.ok is not leaky, d.describe()
    assert (Backend.approved == {}) is leaky
    assert ("refused" in d.reason) is leaky


def test_fla_self_test_says_nothing_of_transformers_fallback(monkeypatch):
    """The self-test calls transformers' torch kernel on purpose, on the GPU where fla runs the
    layers: the kernel wrapper's "falling back ... not installed" warning would mislead, so the
    reference runs say nothing (the stand-in torch kernel logs it as transformers' wrapper does)."""
    import logging

    from vlpack.model import fla_hopper
    from vlpack.model.torch_kernels import FALLBACK_LOGGER

    raw, _ = _stand_in_fla(monkeypatch, leaky=False)
    log = logging.getLogger(FALLBACK_LOGGER)

    def wrapped(*args, **kwargs):
        log.warning("`chunk_gated_delta_rule` is falling back to its reference PyTorch "
                    "implementation because `flash-linear-attention` is not installed.")
        return raw(*args, **kwargs)

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    try:
        assert fla_hopper.self_test(16, 16, torch.device("cpu"), wrapped).ok
    finally:
        log.removeHandler(handler)
    assert seen == []
