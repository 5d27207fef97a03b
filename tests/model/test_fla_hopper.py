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

    def stand_in(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens, initial_state=None):
        host = [0, q.shape[1]] if leaky else cu_seqlens.tolist()
        return torch.cat([raw(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                              initial_state=None if initial_state is None
                              else initial_state[i : i + 1])[0]
                          for i, (s, e) in enumerate(itertools.pairwise(host))], dim=1), None

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


@pytest.mark.parametrize("leaky", [False, True])
def test_a_backend_fla_dispatches_to_is_self_tested_whatever_the_guard(monkeypatch, leaky):
    """FlashQLA (a backend fla's entry point hands the whole delta rule to) is self-tested
    against the torch kernel even where fla's Hopper guard does not apply: a kernel that carries
    state across boundaries is refused, by its name, with its errors; a correct one approved."""
    from vlpack.model import fla_hopper

    raw, Backend = _stand_in_fla(monkeypatch, leaky)
    monkeypatch.setattr(fla_hopper, "guard_applies", lambda: False)
    qla = fla_hopper.Backend("flash_qla", "FLA_FLASH_QLA")
    fla_hopper.decide.cache_clear()
    try:
        d = fla_hopper.decide(16, 16, torch.device("cpu"), raw, heads=3, backend=qla)
        cp = fla_hopper.decide(16, 16, torch.device("cpu"), raw, heads=3, backend=qla, states=True)
        trusted = fla_hopper.decide(16, 16, torch.device("cpu"), raw, heads=3)
    finally:
        fla_hopper.decide.cache_clear()
    grads = {"q", "k", "v", "g", "beta"}
    for decision, states in ((d, set()), (cp, {f"state {n}" for n in grads | {"h0"}})):
        assert decision.ok is not leaky, decision.describe()
        assert "FlashQLA" in decision.reason and set(decision.errors) == (
            grads | {f"long {n}" for n in grads} | states)
        assert ("refused" in decision.reason) is leaky
    assert "long dq" in d.describe() and "state dh0" in cp.describe()
    assert trusted.ok and not trusted.errors  # no backend: fla's own backward, as before
    assert Backend.approved == {}  # the backend's self-test approves no tiling of fla's


def test_dispatched_backend_follows_flas_registry(monkeypatch):
    """`dispatched_backend` names the first backend of fla's registry that is available,
    enabled and accepts the call (fla's own order), None where none does or fla is absent."""
    import sys
    import types

    from vlpack.model import fla_hopper

    class Candidate:
        def __init__(self, kind, available=True, enabled=True, accepts=True, env_var=None,
                     implements=True):
            self.backend_type, self.env_var = kind, env_var
            self.available, self.enabled, self.accepts = available, enabled, accepts
            self.implements = implements

        def is_available(self):
            return self.available

        def is_enabled(self):
            return self.enabled

        def get_implementation(self, name):
            return print if self.implements else None

        def verify(self, name, *args, **kwargs):
            assert name == "chunk_gated_delta_rule" and kwargs["use_qk_l2norm_in_kernel"]
            return self.accepts, None if self.accepts else "no"

    def with_registry(*backends, dispatch_off=False):
        registry = types.SimpleNamespace(_get_sorted_backends=lambda: list(backends))
        module = types.ModuleType("fla.backends")
        module._load_operation_registry = lambda op: registry if op == "gated_delta_rule" else None
        module._DISPATCH_DISABLED = dispatch_off
        monkeypatch.setitem(sys.modules, "fla.backends", module)
        return fla_hopper.dispatched_backend(*[torch.zeros(1)] * 5)

    assert with_registry(Candidate("a", available=False), Candidate("b", enabled=False),
                         Candidate("c", accepts=False), Candidate("e", implements=False),
                         Candidate("flash_qla", env_var="FLA_FLASH_QLA"),
                         Candidate("d")) == ("flash_qla", "FLA_FLASH_QLA")
    assert with_registry(Candidate("x")).switch == "FLA_X"
    assert with_registry(Candidate("c", accepts=False)) is None
    assert with_registry(Candidate("x"), dispatch_off=True) is None  # FLA_DISABLE_BACKEND_DISPATCH
    monkeypatch.setitem(sys.modules, "fla.backends", None)  # fla not installed
    assert fla_hopper.dispatched_backend(*[torch.zeros(1)] * 5) is None


def test_a_refused_backend_stops_the_packed_layer_with_its_switch(monkeypatch):
    """Where fla would hand the packed delta rule to a backend that vlpack's self-test refuses,
    the layer raises a ValueError that names the backend and the variable switching it off,
    instead of training on it or falling back in silence; an approved one runs, said in the
    paths report."""
    from vlpack.model import fla_hopper, gdn
    from vlpack.model.bounds import Boundaries

    raw, _ = _stand_in_fla(monkeypatch, leaky=False)
    qla = fla_hopper.Backend("flash_qla", "FLA_FLASH_QLA")
    monkeypatch.setattr(gdn, "_use_fla", lambda x: True)
    monkeypatch.setattr(gdn, "_fla", lambda: (None, lambda *a, **k: ("ran", None)))
    monkeypatch.setattr(fla_hopper, "dispatched_backend", lambda *a: qla)
    verdict = {}
    monkeypatch.setattr(fla_hopper, "decide", lambda *a, **k: verdict["d"])
    x = [torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3)]
    g, beta = torch.rand(1, 8, 2, requires_grad=True), torch.rand(1, 8, 2, requires_grad=True)
    bounds = Boundaries(None)
    verdict["d"] = fla_hopper.Decision(False, "FlashQLA (fla's flash_qla backend) is refused")
    with pytest.raises(ValueError, match=r"FlashQLA.*refused.*FLA_FLASH_QLA=0"):
        gdn._delta_rule_kernel(*x, g, beta, bounds, raw, torch_only=False)
    verdict["d"] = fla_hopper.Decision(True, "FlashQLA (fla's flash_qla backend) approved")
    kernel = gdn._delta_rule_kernel(*x, g, beta, bounds, raw, torch_only=False)
    assert kernel is not None and kernel.backend == qla and kernel.fn()[0] == "ran"
    assert "FlashQLA" in gdn._via(kernel) and "approved" in bounds.paths["gdn.backward"]
