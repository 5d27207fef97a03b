"""Boundary-aware Gated-DeltaNet (Qwen3.5 linear-attention layers) for packed rows.

`GatedDeltaNet` is the seam: a mixin over transformers' GDN class (one subclass per family,
installed by class in seams.py) whose `forward` restarts the short causal conv and the recurrent
delta-rule state at every boundary of the forward's `Boundaries`:
  GPU + fla importable + half precision → fla's `causal_conv1d` / `chunk_gated_delta_rule`
                                          with `cu_seqlens`;
  otherwise → a per-segment torch conv and transformers' torch delta rule once per segment
              (exact, slower; said once).
The projections, gates and norm are the stock forward's, op for op (the CPU suite compares the
packed forward with the stock one sample at a time). Called without Boundaries (a stock model,
an unpacked sample) the subclass runs the stock forward unchanged.

transformers' own kernel seam for these functions (`use_kernelized_func`) needs the hub
`kernels` package, which vlpack does not use (no downloads at run time).

fla 0.6.0 refuses the backward of its gated delta rule on Hopper with Triton 3.4-3.7.0 (wrong
results at one tiling, fla #640) unless tilelang is installed; fla_hopper.py decides per head
shape, with a self-test on the device, whether fla's backward runs; where it is refused the
delta rule runs per segment in torch when gradients are needed (the conv still uses fla), and
the reason is in the paths report (`gdn.backward`).

Legend: B = batch (1 when packed), C = conv channels, T = tokens, W = conv width,
Hk/Hv = key/value heads, Dk/Dv = head dims.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vlpack.model import fla_hopper
from vlpack.model.bounds import BOUNDS_KWARG, Boundaries, Segments
from vlpack.model.torch_kernels import torch_function


@functools.cache
def _fla() -> tuple[Callable, Callable] | None:
    """fla's (causal_conv1d, chunk_gated_delta_rule), or None when fla cannot run here."""
    try:
        conv = importlib.import_module("fla.modules.causal_conv1d.ops").causal_conv1d
        gdr = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:
        return None
    return conv, gdr


def _fla_bounds(fn: Callable, segs: Segments, bounds: Boundaries | None, device,
                chunk: int | None = None) -> dict:
    """The boundary kwargs of an fla call: `cu_seqlens` on the device and, where fla takes
    them, `cu_seqlens_cpu` (the host copy, so fla never reads the device tensor back) and, for
    a packed row whose kernel's chunk size `chunk` is known, `chunk_indices`
    (`Boundaries.fla_chunks`: fla's own copy of them to the device is a blocking one).
    Within one forward every GDN layer gets the same tensors (`Boundaries.fla_cu`): fla caches
    by argument identity."""
    row = bounds is not None and bounds.row is segs
    if row:
        cu_dev, cu_cpu = bounds.fla_cu(torch.device(device))
    else:
        cu_cpu = torch.tensor(segs.host, dtype=torch.long)
        cu_dev = cu_cpu.to(device)
    params = _fla_params(fn)
    kw = {"cu_seqlens": cu_dev}
    if "cu_seqlens_cpu" in params:
        kw["cu_seqlens_cpu"] = cu_cpu
    if row and chunk and "chunk_indices" in params:
        kw["chunk_indices"] = bounds.fla_chunks(torch.device(device), chunk)
    return kw


@functools.cache
def _fla_chunk() -> int | None:
    """The chunk size fla's causal conv and delta rule cut a row into (the `chunk_size`
    default of their autograd Functions, which vlpack's calls leave as it is), or None when
    fla is absent or the two disagree: then fla builds its chunk indices itself."""
    try:
        conv = importlib.import_module("fla.modules.causal_conv1d.ops").CausalConv1dFunction
        gdr = importlib.import_module("fla.ops.gated_delta_rule.chunk").ChunkGatedDeltaRuleFunction
    except Exception:
        return None
    sizes = {getattr(inspect.signature(f.forward).parameters.get("chunk_size"), "default", None)
             for f in (conv, gdr)}
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) else None


@functools.cache
def _fla_params(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _use_fla(x: torch.Tensor) -> bool:
    """fla's kernels for half-precision inputs on CUDA. float32 inputs run the exact per-segment
    torch path: fla's Triton kernels multiply in TF32 there (its fp32 delta-rule forward puts the
    tiny Qwen3.5's logits past the contract's float32 tolerance: docs/benchmarks/gpu_tests.md),
    and float32 is what `vlpack check` proves the boundary contract in."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if _fla() is None:
        warnings.warn("vlpack: fla is not importable; Gated-DeltaNet runs the per-segment torch "
                      "reference (correct, slower). Install fla-core + flash-linear-attention.",
                      stacklevel=2)
        return False
    return True


# --- short causal conv --------------------------------------------------------------------------
def segment_conv1d(x_BCT, weight_CW, bias_C, activation: str | None, segs: Segments, *,
                   bounds: Boundaries | None = None, torch_only: bool = False):
    """Causal depthwise conv that restarts at every boundary of `segs` (B must be 1); the
    kernel's name lands in `bounds.paths` when given. `torch_only` keeps fla out."""
    from transformers.activations import ACT2FN

    B, C, T = x_BCT.shape
    if B != 1:
        raise ValueError("packed Gated-DeltaNet needs batch size 1 (one packed row)")
    segs.check(T, "Gated-DeltaNet")
    paths = bounds.paths if bounds is not None else {}
    if not torch_only and _use_fla(x_BCT):
        paths["gdn.conv"] = "fla causal_conv1d (cu_seqlens)"
        conv = _fla()[0]
        y_BTC, _ = conv(x_BCT.transpose(1, 2).contiguous(), weight=weight_CW, bias=bias_C,
                        activation=activation,
                        **_fla_bounds(conv, segs, bounds, x_BCT.device, _fla_chunk()))
        return y_BTC.transpose(1, 2).to(x_BCT.dtype)
    paths["gdn.conv"] = "per-segment torch conv1d"
    bounds_S1 = segs.host
    pad = weight_CW.shape[-1] - 1
    x = x_BCT.to(weight_CW.dtype)
    outs = [
        F.conv1d(x[:, :, s:e], weight_CW.unsqueeze(1), bias_C, padding=pad, groups=C)[:, :, : e - s]
        for s, e in itertools.pairwise(bounds_S1)
    ]
    y = torch.cat(outs, dim=-1)
    if activation is not None:
        y = ACT2FN[activation](y)
    return y.to(x_BCT.dtype)


def context_conv1d(x_BCR, weight_CW, bias_C, activation: str | None, split, *,
                   bounds: Boundaries | None = None, torch_only: bool = False):
    """`segment_conv1d` over this rank's tokens of a context-parallel row [1, C, R]: each of its
    chunks gets the W−1 tokens before it in its sample (its left halo) from the ranks holding
    them, the conv runs over halo + chunk (restarting at each), and the halo's outputs are
    dropped. One gather of every chunk's last W−1 tokens (small); exact."""
    h = weight_CW.shape[-1] - 1
    chunks = split.shard.chunks
    cp, r = split.group.size, split.group.rank
    C = x_BCR.shape[1]
    # every local chunk's last h tokens (left-padded with zeros when shorter), gathered
    tails = torch.stack([F.pad(x_BCR[0, :, c.q_start + max(c.length - h, 0): c.q_start + c.length],
                               (max(h - c.length, 0), 0)) for c in chunks])  # [n, C, h]
    gathered = split.gather_rows(tails)  # [cp·n, C, h], rank-major

    def tail(sample: int, index: int) -> torch.Tensor:  # the last h tokens of chunk `index`
        return gathered[split.chunk_row(sample, index)]

    pieces, keep, cu = [], [], [0]
    for j, c in enumerate(chunks):
        sample, index = j // 2, (r if j % 2 == 0 else 2 * cp - 1 - r)
        have = min(h, index * c.length)  # halo tokens inside the sample
        if have:
            back = -(-have // c.length)  # chunks the halo reaches into
            parts = [tail(sample, index - m)[:, h - min(h, c.length):] for m in range(back, 0, -1)]
            pieces.append(torch.cat(parts, dim=1)[:, -have:])
        pieces.append(x_BCR[0, :, c.q_start : c.q_start + c.length])
        keep.append(torch.arange(cu[-1] + have, cu[-1] + have + c.length))
        cu.append(cu[-1] + have + c.length)
    x = torch.cat(pieces, dim=1)[None]
    assert x.shape[1] == C
    y = segment_conv1d(x, weight_CW, bias_C, activation,
                       Segments.from_host(tuple(cu), x.device), bounds=bounds,
                       torch_only=torch_only)
    return y.index_select(2, torch.cat(keep).to(y.device))


# --- gated delta rule ---------------------------------------------------------------------------
def gates(a, b, A_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's decay g (float32) and beta from the gate projections' outputs `a` and
    `b` [B, T, Hv], as the stock forward computes them: g = -exp(A_log)·softplus(a + dt_bias)
    in float32, beta = sigmoid(b) in b's dtype."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def repeat_heads(query, key, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [B, T, Hk, Dk] repeated to `value_heads` heads (value head h reads key head
    h // (Hv / Hk), repeat_interleave's order), as transformers' torch kernel takes them."""
    r = value_heads // query.shape[2]
    if r == 1:
        return query, key
    return query.repeat_interleave(r, dim=2), key.repeat_interleave(r, dim=2)


def segment_delta_rule(query, key, value, g, beta, segs: Segments, bounds: Boundaries, *,
                       torch_fn: Callable, torch_only: bool = False) -> torch.Tensor:
    """The chunked gated delta rule over a packed row [1, T, H, D] (q/k already repeated to the
    value heads), its recurrent state restarted at every boundary of `segs`; q and k are
    L2-normalised in the kernel. `torch_fn` is transformers' torch kernel (the per-segment path);
    `torch_only` keeps fla out."""
    B, T = query.shape[:2]
    if B != 1:
        raise ValueError("packed Gated-DeltaNet needs batch size 1 (one packed row)")
    segs.check(T, "Gated-DeltaNet")
    gdr = _delta_rule_kernel(query, key, value, g, beta, bounds, torch_fn, torch_only)
    if gdr is not None:
        bounds.paths["gdn.delta_rule"] = "fla chunk_gated_delta_rule (cu_seqlens)" + _via(gdr)
        out, _ = gdr.fn(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                        **_fla_bounds(gdr.fn, segs, bounds, query.device, _fla_chunk()))
        return out
    bounds.paths["gdn.delta_rule"] = "per-segment torch chunk_gated_delta_rule"
    outs = [
        torch_fn(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                 use_qk_l2norm_in_kernel=True)[0]
        for s, e in itertools.pairwise(segs.host)
    ]
    return torch.cat(outs, dim=1)


class _Kernel(NamedTuple):
    """fla's delta-rule entry point and the backend it dispatches this call to (None: fla's
    Triton kernels)."""

    fn: Callable
    backend: fla_hopper.Backend | None


def _refused(decision: fla_hopper.Decision, backend: fla_hopper.Backend) -> ValueError:
    return ValueError(f"vlpack: {decision.describe()}. Run with {backend.switch}=0 to train "
                      "with fla's Triton kernels instead")


def _via(kernel: _Kernel) -> str:
    return f", run by {kernel.backend.name}" if kernel.backend is not None else ""


def _delta_rule_kernel(query, key, value, g, beta, bounds: Boundaries, torch_fn: Callable,
                       torch_only: bool, states: bool = False) -> _Kernel | None:
    """fla's varlen delta rule where it runs (and its backward is approved), else None: the
    same decision as `segment_delta_rule`, said in `bounds.paths`; `states`: the calls start
    from initial states (context parallelism). A backend fla hands the call to (FlashQLA) that
    fails vlpack's self-test stops the run: ValueError with its switch."""
    if torch_only or not _use_fla(query):
        return None
    backend = fla_hopper.dispatched_backend(query, key, value, g, beta)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, g, beta)):
        decision = fla_hopper.decide(key.shape[-1], value.shape[-1], query.device, torch_fn,
                                     heads=value.shape[2], backend=backend,
                                     states=states and backend is not None)
        bounds.paths["gdn.backward"] = decision.describe()
        if not decision.ok and backend is not None:
            raise _refused(decision, backend)
        if not decision.ok:
            _warn_once(f"vlpack: {decision.describe()}; the delta rule runs per segment in "
                       "torch (install tilelang or Triton >= 3.7.1 for fla's backward)")
            return None
    return _Kernel(_fla()[1], backend)


def context_delta_rule(query, key, value, g, beta, split, bounds: Boundaries, *,
                       torch_fn: Callable, torch_only: bool = False) -> torch.Tensor:
    """The delta rule over this rank's tokens of a context-parallel row [1, R, H, D], exact:
    every sample's recurrent state passes from chunk to chunk across the ranks.

    The state after a chunk is affine in the state before it: S_out = A·S_in + B (A [Dk, Dk]
    per head: the chunk's product of decays and Householder-like updates; B: the chunk's state
    from a zero start). Each rank computes A (the chunk run from the identity with zero values)
    and B (the run from zero) for its chunks, the group gathers them (small: a state per chunk),
    every rank scans each sample's chunks in order for its chunks' starting states, and runs
    its chunks once more from those states for the outputs. Gradients flow back through the
    scan and the gather to the ranks that own the earlier chunks."""
    chunks = split.chunks_q
    n = len(chunks.host) - 1  # this rank's chunks: two per sample (chunks r and 2·cp−1−r)
    H, Dk = key.shape[2], key.shape[3]
    gdr = _delta_rule_kernel(query, key, value, g, beta, bounds, torch_fn, torch_only,
                             states=True)
    bounds.paths["gdn.delta_rule"] = (
        "fla chunk_gated_delta_rule (cu_seqlens)" + _via(gdr) + ", state passed across ranks"
        if gdr is not None else "per-chunk torch chunk_gated_delta_rule, state passed across ranks")

    def run(v, initial):  # (outputs [1, R, H, Dv], final states [n, H, Dk, Dv]) of the chunks
        if gdr is not None:
            out, final = gdr.fn(query, key, v, g=g, beta=beta, initial_state=initial,
                                output_final_state=True, use_qk_l2norm_in_kernel=True,
                                **_fla_bounds(gdr.fn, chunks, None, query.device))
            return out, final
        outs, finals = [], []
        for j, (s, e) in enumerate(itertools.pairwise(chunks.host)):
            o, f = torch_fn(query[:, s:e], key[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                            initial_state=None if initial is None else initial[j : j + 1],
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, dim=1), torch.cat(finals, dim=0)

    eye = torch.eye(Dk, device=key.device, dtype=torch.float32).expand(n, H, Dk, Dk)
    _, b_state = run(value, None)
    _, a_state = run(value.new_zeros((*value.shape[:3], Dk)), eye.contiguous())
    summary = torch.cat([a_state.float(), b_state.float()], dim=-1)  # [n, H, Dk, Dk + Dv]
    gathered = split.gather_rows(summary)  # [cp·n, ...], rank-major
    cp, r = split.group.size, split.group.rank
    samples = n // 2
    state = b_state.new_zeros((samples, *b_state.shape[1:]), dtype=torch.float32)
    starts = [None, None]
    for c in range(2 * cp):  # each sample's chunks in row order
        if c in (r, 2 * cp - 1 - r):
            starts[0 if c == r else 1] = state
        rows = gathered[[split.chunk_row(s, c) for s in range(samples)]]
        state = rows[..., :Dk] @ state + rows[..., Dk:]
    initial = torch.stack(starts, dim=1).reshape(n, *b_state.shape[1:])  # local chunk order
    out, _ = run(value, initial.to(b_state.dtype))
    return out


class GatedDeltaNet:
    """Mixin over a transformers Gated-DeltaNet class (`_vlpack_stock`): the packed forward."""

    _vlpack_stock: type
    conv_on_torch: bool = False
    """Run the short convolution per segment in torch (transformers' fallback arithmetic: the
    conv, then the activation on its rounded output) even where fla runs the delta rule; a
    subclass sets it (bench/bf16_offset.py's `-conv` way)."""

    def forward(self, hidden_states, *args, **kwargs):
        bounds: Boundaries | None = kwargs.pop(BOUNDS_KWARG, None)
        split = bounds.context if bounds is not None else None
        if split is not None:  # one rank's share of a context-parallel row (context.py)
            return self._packed(hidden_states, split.row_segments, bounds, torch_only=False,
                                split=split)
        if bounds is None or bounds.text is None:
            self._approve_stock_backward(hidden_states)
            return super().forward(hidden_states, *args, **kwargs)
        if args or kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
            raise ValueError("packed Gated-DeltaNet runs without a cache: call with "
                             "use_cache=False")
        if kwargs.get("attention_mask") is not None:
            raise ValueError("a packed row has no attention mask: its boundaries come from "
                             "vlpack's Boundaries")
        if kwargs.get("seq_idx") is not None:
            raise ValueError("pass boundaries as vlpack's Boundaries, not seq_idx")
        return self._packed(hidden_states, bounds.text, bounds, torch_only=False)

    def _approve_stock_backward(self, x: torch.Tensor) -> None:
        """The stock forward (padded batches, unpacked samples) calls fla's delta rule where fla
        is importable (transformers picks it); on Hopper with Triton 3.4-3.7.0 fla refuses its own backward
        (fla #640) unless vlpack's backend approved the layer's head shape. Decide it here, as
        the packed path does; a refused shape is a clear error instead of fla's."""
        if not (x.is_cuda and torch.is_grad_enabled() and _fla() is not None):
            return
        torch_fn = torch_function(self._vlpack_stock, "torch_chunk_gated_delta_rule")
        # a call of the layer's shape and dtype, as transformers makes it (q/k repeated to the
        # value heads, in the autocast dtype or the input's)
        H, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        q = x.new_empty((1, 1, H, K), dtype=dtype).requires_grad_()
        backend = fla_hopper.dispatched_backend(q, q, x.new_empty((1, 1, H, V), dtype=q.dtype),
                                                x.new_empty((1, 1, H)), q.new_empty((1, 1, H)))
        decision = fla_hopper.decide(K, V, x.device, torch_fn, heads=H, backend=backend)
        if not decision.ok and backend is not None:
            raise _refused(decision, backend)
        if not decision.ok:
            raise ValueError(f"{decision.describe()}: transformers' Gated-DeltaNet forward (padded "
                             "batches) would call fla's refused backward. Train packed "
                             "(data.packing=bfd), or install tilelang or Triton >= 3.7.1")

    def _packed(self, x_BTD: torch.Tensor, segs: Segments, bounds: Boundaries, *,
                torch_only: bool, split=None) -> torch.Tensor:
        """The packed forward over `segs`. With a context-parallel `split` x holds this rank's
        tokens: the projections, the conv (`context_conv1d`, each chunk with its left halo from
        the ranks holding it) and the delta rule (`context_delta_rule`, the recurrent state
        passed across ranks) all run on them."""
        B, T, _ = x_BTD.shape
        mixed_BCT = self.in_proj_qkv(x_BTD).transpose(1, 2)
        z = self.in_proj_z(x_BTD).reshape(B, T, -1, self.head_v_dim)
        b = self.in_proj_b(x_BTD)
        a = self.in_proj_a(x_BTD)
        conv = segment_conv1d if split is None else context_conv1d
        mixed_BCT = conv(mixed_BCT, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                         self.activation, segs if split is None else split, bounds=bounds,
                         torch_only=torch_only or self.conv_on_torch)
        query, key, value = torch.split(mixed_BCT.transpose(1, 2),
                                        [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(B, T, -1, self.head_k_dim)
        key = key.reshape(B, T, -1, self.head_k_dim)
        value = value.reshape(B, T, -1, self.head_v_dim)
        g, beta = gates(a, b, self.A_log, self.dt_bias)
        query, key = repeat_heads(query, key, self.num_v_heads)
        torch_fn = torch_function(self._vlpack_stock, "torch_chunk_gated_delta_rule")
        if split is None:
            out = segment_delta_rule(query, key, value, g, beta, segs, bounds,
                                     torch_fn=torch_fn, torch_only=torch_only)
        else:
            out = context_delta_rule(query, key, value, g, beta, split, bounds,
                                     torch_fn=torch_fn, torch_only=torch_only)
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(B, z.shape[1], -1))
