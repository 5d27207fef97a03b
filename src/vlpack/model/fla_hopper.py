"""fla's gated-delta-rule backward on Hopper with Triton 3.4-3.7.0, where it is correct.

fla 0.6.0 refuses its gated-delta-rule backward on Hopper with Triton >= 3.4, < 3.7.1 (unless
tilelang is installed): one kernel, `chunk_bwd_kernel_dqkwg`, miscompiles there (fla #640). The
upstream bisection (fla PR #826, PR #983) pins the miscompile to block width 64; 32 and 128
compute correctly. On a Hopper GPU fla tiles that kernel min(next_pow2(head dim), 128) wide, so
Qwen3.5's head dim 128 gets the correct width 128.

vlpack decides per (device, key dim, value dim, heads), once per process:
  1. fla's guard does not apply (another GPU, Triton >= 3.7.1, tilelang) → fla's own backward;
  2. the tiling fla would use has width 64 → refused, the delta rule runs per segment in torch;
  3. otherwise a numerical self-test on the device: fla's varlen forward and backward against
     transformers' torch kernel run per segment in float32, on a small packed row of that head
     shape. Each gradient's error must be within 2× the error of the same torch kernel fed
     bfloat16 inputs (the bf16 rule of `vlpack check`). The row has the layer's head count, so
     the self-test's Triton autotuning of fla's kernels, most of it keyed on head counts and
     dims rather than tokens, serves the layer too. Passed → fla's backward kernel runs through
     `VlpackHopperBackend`, registered with fla's own backend registry (`fla.backends`) for the
     approved shapes only; failed → refused.
The decision and the self-test's errors go into the forward's paths report (`gdn.backward`).

fla's entry point may hand the whole delta rule to another backend (`dispatched_backend`: FlashQLA,
PyPI `flash-qla` on tilelang, where it is importable on Hopper and newer, unless
`FLA_FLASH_QLA=0`). Such a backend's forward and backward are vlpack's to trust too: `decide`
runs the same self-test through fla's entry point for it, whatever fla's guard says, and a
refused backend stops the run with the switch that turns it off (gdn.py).

Legend: T = tokens, H = heads, K/V = key/value head dims, BK/BV = the kernel's block widths.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from vlpack.model.torch_kernels import quiet_fallback

BROKEN_WIDTH = 64
"""The block width of `chunk_bwd_kernel_dqkwg` that Triton 3.4-3.7.0 miscompiles on Hopper."""
SELF_TEST_BOUNDS = (0, 61, 64, 250, 384)
"""The packed row of the self-test: segments that end on and off fla's 64-token chunks."""
SELF_TEST_HEADS = 2
"""The self-test's head count where the caller names none (the CPU tests)."""


@dataclass(frozen=True)
class Decision:
    """Whether fla's delta-rule backward runs for one head shape, and why."""

    ok: bool
    reason: str
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per gradient: (fla's relative error, the bf16 torch kernel's), both against fp32 torch."""

    def describe(self) -> str:
        errs = ", ".join(f"{grad_label(k)} {a:.4f} vs {b:.4f}" for k, a, b in
                         ((k, *v) for k, v in self.errors.items()))
        return self.reason + (f" (self-test, relative error fla vs bf16 torch: {errs})"
                              if errs else "")


def grad_label(key: str) -> str:
    """An error's name as the messages say it: `q` → `dq`, `long q` → `long dq`."""
    *row, name = key.split(" ")
    return " ".join([*row, "d" + name])


def guard_applies() -> bool:
    """fla's own condition for refusing the backward: Hopper, Triton >= 3.4, < 3.7.1, and no
    usable tilelang backend."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except Exception:
        return False
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return False
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except Exception:
        return True
    return not CommonTileLangBackend.can_use()


def fla_tiling(K: int, V: int, device_index: int) -> tuple[int, int]:
    """The block widths (BK, BV) fla 0.6.0's `chunk_bwd_dqkwg` picks for head dims K, V."""
    import triton
    from fla.utils import check_shared_mem

    if check_shared_mem("hopper", device_index):
        cap = 128
    elif check_shared_mem("ampere", device_index):
        cap = 128  # 16-bit inputs, as the delta rule's backward passes them
    elif check_shared_mem("ada", device_index):
        cap = 64
    else:
        cap = 32

    def width(d: int) -> int:
        return min(max(triton.next_power_of_2(d), 16), cap)

    return width(K), width(V)


class VlpackHopperBackend:
    """fla backend (operation `common`) that runs `chunk_bwd_kernel_dqkwg` for the head shapes
    vlpack approved (`approved`: (K, V) → (BK, BV)); fla's own function runs every other call.
    Made a subclass of `fla.backends.BaseBackend` when registered (`_register`)."""

    backend_type = "vlpack_hopper"
    priority = 6  # after tilelang (5), when that is usable
    approved: ClassVar[dict[tuple[int, int], tuple[int, int]]] = {}

    def chunk_bwd_dqkwg_verifier(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None,
                                 dv=None, scale=None, state_v_first=False, cu_seqlens=None,
                                 chunk_size=64, chunk_indices=None) -> tuple[bool, str | None]:
        if g is None or g_gamma is not None:
            return False, "vlpack's backend runs the gated delta rule only"
        if (k.shape[-1], v.shape[-1]) not in self.approved:
            return False, "head shape not approved by vlpack's self-test"
        return True, None

    def chunk_bwd_dqkwg(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None,
                        scale=None, state_v_first=False, cu_seqlens=None, chunk_size=64,
                        chunk_indices=None):
        import triton
        from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg
        from fla.ops.utils import prepare_chunk_indices

        B, T, H, K = k.shape
        V, HV = v.shape[-1], v.shape[2]
        BK, BV = self.approved[(K, V)]
        if chunk_indices is None and cu_seqlens is not None:
            chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
        n_chunks = triton.cdiv(T, chunk_size) if cu_seqlens is None else len(chunk_indices)
        n_k = triton.cdiv(K, BK)
        dq, dk = q.new_empty(B, T, HV, K), k.new_empty(B, T, HV, K)
        dg = torch.empty(n_k, *g.shape, dtype=torch.float32, device=g.device)
        dw = torch.empty_like(w) if w is not None else None
        chunk_bwd_kernel_dqkwg[(n_k * n_chunks, B * HV)](
            q=q, k=k, v=v, g=g, g_gamma=g_gamma, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv,
            dg=dg, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
            scale=k.shape[-1] ** -0.5 if scale is None else scale, B=B, T=T, H=H, HV=HV, K=K,
            V=V, BT=chunk_size, BK=BK, BV=BV, STATE_V_FIRST=state_v_first)
        if H != HV:  # grouped value heads: each q/k head's gradient summed over its value heads
            dq = dq.view(B, T, H, HV // H, K).sum(3)
            dk = dk.view(B, T, H, HV // H, K).sum(3)
        return dq, dk, dw, dg.sum(0)


@functools.cache
def _register() -> type:
    """Register `VlpackHopperBackend` with fla's `common` registry (once per process)."""
    from fla.backends import BaseBackend, register

    importlib.import_module("fla.ops.common.chunk_o")  # the registry the kernel dispatches on
    cls = type("VlpackHopperBackend", (VlpackHopperBackend, BaseBackend), {"__module__": __name__})
    register("common")(cls)
    return cls


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


def self_test(K: int, V: int, device: torch.device, torch_fn: Callable, *,
              width: tuple[int, int] | None = None, approve: bool = True,
              heads: int = SELF_TEST_HEADS) -> Decision:
    """Run fla's varlen gated delta rule forward and backward through vlpack's backend at
    block widths `width` (default: fla's own tiling) on a row of `heads` heads against
    `torch_fn` (transformers' torch kernel) per segment; approve (K, V) if every gradient meets
    the bf16 rule (and `approve`; otherwise the approvals are left as they were)."""
    cls = _register()
    widths = width or fla_tiling(K, V, device.index or 0)
    before = cls.approved.get((K, V))
    cls.approved[(K, V)] = widths
    try:
        errors = compare_with_torch(K, V, device, torch_fn, heads=heads)
    except Exception as e:
        _restore(cls.approved, (K, V), before)
        return Decision(False, f"fla's backward failed to run in its self-test ({e})")
    bad = _outside_bf16_rule(errors)
    if bad or not approve:
        _restore(cls.approved, (K, V), before)
    if bad:
        return Decision(False, f"fla's backward at block widths {widths} is refused: "
                        f"{', '.join(map(grad_label, bad))} outside the bf16 rule", errors)
    return Decision(True, f"fla's backward at block widths {widths} approved", errors)


def _outside_bf16_rule(errors: dict[str, tuple[float, float]]) -> list[str]:
    """The gradients whose error is more than 2x the bf16 torch kernel's (+ 1e-3)."""
    return [n for n, (a, b) in errors.items() if not a <= 2 * b + 1e-3]


def compare_with_torch(K: int, V: int, device: torch.device, torch_fn: Callable, *,
                       heads: int = SELF_TEST_HEADS, bounds: tuple[int, ...] = SELF_TEST_BOUNDS,
                       initial_state: bool = False) -> dict[str, tuple[float, float]]:
    """fla's varlen gated delta rule (whichever backend its entry point dispatches to) forward
    and backward on a packed row of `heads` heads cut at `bounds`, each segment from a random
    recurrent state with `initial_state` (its gradient `h0` compared too), against `torch_fn`
    (transformers' torch kernel) per segment: per gradient, (fla's relative error, the bf16
    torch kernel's), both against the torch kernel in float32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator(device=device).manual_seed(0)
    T, H, N = bounds[-1], heads, len(bounds) - 1

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    base = dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, H, V),
                g=-torch.rand(1, T, H, device=device, generator=gen) * 0.5,
                beta=torch.rand(1, T, H, device=device, generator=gen))
    if initial_state:
        base["h0"] = rand(N, H, K, V) * 0.1
    do = rand(1, T, H, V)

    def grads(fn, dtype):
        # fresh leaves per run; the decay and the states stay float32, as the layer keeps them
        leaves = {n: t.detach().to(torch.float32 if n in ("g", "h0") else dtype).clone()
                  .requires_grad_() for n, t in base.items()}
        with torch.enable_grad():
            out = fn(**leaves)
            torch.autograd.backward(out.float(), do)
        return {n: t.grad.float() for n, t in leaves.items()}

    def per_segment(q, k, v, g, beta, h0=None):
        return torch.cat([torch_fn(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e],
                                   beta=beta[:, s:e], use_qk_l2norm_in_kernel=True,
                                   initial_state=None if h0 is None else h0[i : i + 1])[0]
                          for i, (s, e) in enumerate(itertools.pairwise(bounds))], dim=1)

    cu = torch.tensor(bounds, dtype=torch.long, device=device)

    def fla(q, k, v, g, beta, h0=None):
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]

    # The self-test runs inside the first forward of a GDN layer, which activation
    # checkpointing may wrap: identity saved-tensor hooks (the innermost win) keep the
    # checkpoint from capturing the self-test's own tensors and recomputing the layer in its
    # backward.
    plain_saving = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with plain_saving, torch.autocast(device.type, enabled=False), quiet_fallback():
        ref = grads(per_segment, torch.float32)
        plain = grads(per_segment, torch.bfloat16)
    with plain_saving, torch.autocast(device.type, enabled=False):
        fast = grads(fla, torch.bfloat16)
    return {n: (_rel(fast[n], ref[n]), _rel(plain[n], ref[n])) for n in ref}


BACKEND_NAMES = {"flash_qla": "FlashQLA (fla's flash_qla backend)"}
"""How the paths report and the messages name a backend of fla's delta rule."""


class Backend(NamedTuple):
    """A backend of fla's delta rule other than its Triton kernels: its type (fla's
    `backend_type`) and the environment variable that switches it off (`=0`)."""

    kind: str
    switch: str

    @property
    def name(self) -> str:
        return BACKEND_NAMES.get(self.kind, f"fla's {self.kind} backend")


def dispatched_backend(q, k, v, g, beta) -> Backend | None:
    """The backend fla's `chunk_gated_delta_rule` dispatches this call to (its registry's
    first available, enabled backend with an implementation whose verifier accepts the call,
    as fla's dispatch picks it), or None for fla's own Triton kernels: also where fla's
    dispatch is off (`FLA_DISABLE_BACKEND_DISPATCH=1`) or its registry cannot be read."""
    try:
        fla_backends = importlib.import_module("fla.backends")
        if getattr(fla_backends, "_DISPATCH_DISABLED", False):
            return None
        candidates = (fla_backends._load_operation_registry("gated_delta_rule")
                      ._get_sorted_backends())
    except Exception:
        return None
    name = "chunk_gated_delta_rule"
    for b in candidates:
        if (b.is_available() and b.is_enabled() and b.get_implementation(name) is not None
                and b.verify(name, q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]):
            return Backend(b.backend_type, b.env_var or f"FLA_{b.backend_type.upper()}")
    return None


BACKEND_ROWS = {"": SELF_TEST_BOUNDS, "long ": (0, 7000, 8192)}
"""A backend's self-test rows (by the prefix of their errors' names): the Hopper self-test's, and
one long segment in a row of 8,192 tokens, where FlashQLA splits a sequence within the card
(its `auto_cp`: few sequences for the heads). With `states` the first also from random
initial states (`state ` prefix), as context parallelism runs each rank's chunks."""


def self_test_backend(backend: Backend, K: int, V: int, device: torch.device,
                      torch_fn: Callable, heads: int = SELF_TEST_HEADS,
                      states: bool = False) -> Decision:
    """The self-test of a backend that fla's entry point dispatches the whole delta rule to, on
    `BACKEND_ROWS` (and from initial states with `states`): approved when every gradient meets
    the bf16 rule, else refused with its errors."""
    name = backend.name + (" from initial states" if states else "")
    errors: dict[str, tuple[float, float]] = {}
    try:
        for prefix, bounds in BACKEND_ROWS.items():
            errors |= {prefix + n: e for n, e in compare_with_torch(
                K, V, device, torch_fn, heads=heads, bounds=bounds).items()}
        if states:
            errors |= {"state " + n: e for n, e in compare_with_torch(
                K, V, device, torch_fn, heads=heads, initial_state=True).items()}
    except Exception as e:
        return Decision(False, f"{name} failed to run in vlpack's self-test ({e})")
    if bad := _outside_bf16_rule(errors):
        return Decision(False, f"{name} is refused by vlpack's self-test: "
                        f"{', '.join(map(grad_label, bad))} outside the bf16 rule", errors)
    return Decision(True, f"{name} approved", errors)


def _restore(approved: dict, key: tuple[int, int], before: tuple[int, int] | None) -> None:
    if before is None:
        approved.pop(key, None)
    else:
        approved[key] = before


@functools.cache
def decide(K: int, V: int, device: torch.device, torch_fn: Callable,
           heads: int = SELF_TEST_HEADS, backend: Backend | None = None,
           states: bool = False) -> Decision:
    """Whether fla's gated-delta-rule backward runs for head dims K, V on `device` (cached per
    process; see the module docstring for the order of the rules); `heads`, the layer's head
    count, sizes the self-test's row; `backend`, the backend fla dispatches the call to
    (`dispatched_backend`), is self-tested whatever fla's guard says, from initial states too
    for calls that start from them (`states`: context parallelism)."""
    if backend is not None:
        return self_test_backend(backend, K, V, device, torch_fn, heads, states)
    if not guard_applies():
        return Decision(True, "fla's own backward (fla's Hopper guard does not apply here)")
    widths = fla_tiling(K, V, device.index or 0)
    if BROKEN_WIDTH in widths:
        return Decision(False, f"fla would tile its backward {widths[0]}x{widths[1]}; width "
                        f"{BROKEN_WIDTH} miscompiles on Hopper with this Triton (fla #640)")
    return self_test(K, V, device, torch_fn, heads=heads)
