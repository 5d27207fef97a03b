"""Routed experts under autocast: one grouped GEMM per projection in the autocast dtype.

transformers' `grouped_mm` experts call torch's grouped GEMM in the dtype of the expert weights
(the grouped GEMM is not autocast-enabled). With float32 master weights under bf16 autocast, the
recipe's setting, that is torch's float32 grouped GEMM, which splits the rows per expert on the
host: a host wait per call and one small float32 matmul per expert. `vlpack_grouped_mm`,
registered with transformers' ExpertsInterface and set on vlpack's MoE models at build time,
casts the weights and the routed rows to the autocast dtype first, as autocast does for a linear
layer, and computes the group offsets on the device; weights already held in that dtype (a
frozen base, train/setup/precision.py) take the same path, so holding them there changes no result.
Outside autocast it is transformers' `grouped_mm` unchanged, except for int8 weights
(`model.frozen_dtype=int8`, model/quant.py), which it runs in the hidden states' dtype.

`vlpack_grouped_mm_compiled` (set by model/compile.py when a compile scope is on) runs the same
dispatch as one compiled function: inductor fuses the row gathers, the casts and the SiLU gate
with the routing weight around the two grouped GEMMs, which otherwise make several memory-bound
passes over the routed rows (docs/benchmarks.md, the 35B at 32k bins); the sum over each token's
K outputs and the row gather's backward, the same sum, run vlpack's row-sum kernel on CUDA
(model/rows.py: `gather_sum`, checked against the torch expression once per device). The
routing weight scales the down projection's P × I input rather than its P × D output, so the
weight's gradient reduces over I (512 in the 35B) instead of D (2,048) and fuses with the
gate's backward. The token count is a dynamic size (one graph for every bin); K, the experts
per token, is marked static: the model's constant (the row sum's unrolled loop).

LoRA on the routed experts (`model.lora.experts`, model/lora.py) reaches the dispatch as factors
(`ExpertAdapter`: A [E, r, X], B [E, O, r] and the scale), not as an adapted weight: each
projection adds `scale · (rows · A[e]ᵀ) · B[e]ᵀ` through two more grouped GEMMs over the same
groups. Neither the per-expert update B·A nor a full-size weight gradient is ever formed (peft's
parametrization forms W + B·A, a copy of the whole expert stack, and autograd then a gradient
of that size to reach A and B); the update is added to the projection's output in the compute
dtype, as for a linear layer, instead of being rounded into a bf16-held weight.

Legend: T = tokens, D = hidden size, I = expert intermediate size, E = experts, K = experts per
token, P = routed (token, expert) pairs = T * K; X, O = a projection's input and output widths;
R = a LoRA rank padded to a multiple of 8.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vlpack.model import rows
from vlpack.model.quant import dequantize, scales

IMPLEMENTATION = "vlpack_grouped_mm"
COMPILED = "vlpack_grouped_mm_compiled"


def routed_expert(name: str) -> bool:
    """Whether the parameter or module `name` (a dotted path) is, or lies inside, a MoE block's
    routed experts (`...mlp.experts.gate_up_proj`, `...mlp.experts.3.down_proj`); the shared
    expert (`...mlp.shared_expert...`) is not."""
    return ".experts." in f".{name}."


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _grouped_mm(a_PX: torch.Tensor, b_EXY: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a_PX, b_EXY, offs=offs_E)


def _plain_layout(experts) -> bool:
    """Concatenated [gate; up] weights [E, 2I, D], down [E, D, I], no bias, no post-expert norm,
    no expert parallelism: the layout of every Qwen MoE family (attributes that a transformers
    version does not set are taken at their defaults)."""
    flags = dict(has_bias=False, has_gate=True, is_transposed=False, is_concatenated=True,
                 has_post_expert_norm=False, _is_expert_parallel=False)
    return all(getattr(experts, k, default) == default for k, default in flags.items())


@torch.library.custom_op("vlpack::int8_grouped_mm", mutates_args=())
def int8_grouped_mm(a_PX: torch.Tensor, q_EOX: torch.Tensor, scale_EO: torch.Tensor,
                    offs_E: torch.Tensor, transpose: bool) -> torch.Tensor:
    """`a_PX @ w[e].T` per expert group (`transpose`; else `a @ w[e]`) for the int8 weight
    `q_EOX` with row scales `scale_EO` (model/quant.py), dequantized to `a_PX`'s dtype. One
    opaque op, so neither autograd nor the compiler keeps the dequantized weight: backward
    saves the int8 weight and dequantizes it again. The weight is frozen (no gradient)."""
    w_EOX = dequantize(q_EOX, scale_EO, a_PX.dtype)
    return _grouped_mm(a_PX, w_EOX.transpose(-2, -1) if transpose else w_EOX, offs_E)


@int8_grouped_mm.register_fake
def _(a_PX, q_EOX, scale_EO, offs_E, transpose):
    return a_PX.new_empty((a_PX.shape[0], q_EOX.shape[1] if transpose else q_EOX.shape[2]))


def _int8_setup(ctx, inputs, output) -> None:
    _, q_EOX, scale_EO, offs_E, transpose = inputs
    ctx.save_for_backward(q_EOX, scale_EO, offs_E)
    ctx.transpose = transpose


def _int8_backward(ctx, grad):
    q_EOX, scale_EO, offs_E = ctx.saved_tensors
    return int8_grouped_mm(grad, q_EOX, scale_EO, offs_E, not ctx.transpose), None, None, None, None


int8_grouped_mm.register_autograd(_int8_backward, setup_context=_int8_setup)


class ExpertAdapter(NamedTuple):
    """The LoRA factors of one expert weight [E, O, X]: its update is `scale · b[e] @ a[e]` per
    expert, `a` [E, R, X] and `b` [E, O, R] (R: the rank, padded with zeros to a multiple of 8,
    which the GPU's grouped GEMM needs for its strides)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def _project(a_PX: torch.Tensor, w_EOX: torch.Tensor, scale_EO: torch.Tensor | None,
             offs_E: torch.Tensor, dtype: torch.dtype,
             adapter: ExpertAdapter | None = None) -> torch.Tensor:
    """One grouped projection in `dtype` (out = a @ w[e].T): an int8 weight when it has scales;
    plus `adapter`'s low-rank update, as two grouped GEMMs through rank R."""
    if scale_EO is None:
        out_PO = _grouped_mm(a_PX, w_EOX.to(dtype).transpose(-2, -1), offs_E)
    else:
        out_PO = int8_grouped_mm(a_PX.to(dtype), w_EOX, scale_EO, offs_E, True)
    if adapter is None:
        return out_PO
    low_PR = _grouped_mm(a_PX, adapter.a.to(dtype).transpose(-2, -1), offs_E)
    return out_PO + adapter.scale * _grouped_mm(low_PR, adapter.b.to(dtype).transpose(-2, -1),
                                                offs_E)


class _RouteRows(torch.autograd.Function):
    """`x_TD[token_P]`: each token's row once per routed pair, pairs sorted by expert. Backward
    sums each token's K row gradients in float32 by gathering them (`inverse_P`: a pair's
    position in expert order; model/rows.py's op with `kernel`, else its torch expression),
    deterministic and without the scatter-add of indexing."""

    @staticmethod
    def forward(x_TD, token_P, inverse_P, K, kernel):
        return x_TD[token_P]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.K, ctx.kernel = inputs[3], inputs[4]

    @staticmethod
    def backward(ctx, grad_PD):
        (inverse_P,) = ctx.saved_tensors
        row_sum = rows.gather_sum if ctx.kernel else rows.reference
        return row_sum(grad_PD, inverse_P, ctx.K, grad_PD.dtype), None, None, None, None


class _CombineRows(torch.autograd.Function):
    """Each token's K pair outputs summed in float32 (`out_PD` at `inverse_P`: model/rows.py's op
    with `kernel`, else its torch expression) and stored in the hidden states' dtype, in the
    order of its K experts: deterministic, no atomics, as transformers' un-permute and sum.
    Backward gathers each pair's token gradient (`token_P`) instead of scattering it."""

    @staticmethod
    def forward(out_PD, inverse_P, token_P, K, kernel, out_dtype):
        row_sum = rows.gather_sum if kernel else rows.reference
        return row_sum(out_PD, inverse_P, K, out_dtype)  # summed in float32, stored in out_dtype

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx, grad_TD):
        (token_P,) = ctx.saved_tensors
        return grad_TD.to(ctx.dtype)[token_P], None, None, None, None, None


def _dispatch(x_TD: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor,
              gate_up_E2ID: torch.Tensor, down_EDI: torch.Tensor, gate: Callable,
              dtype: torch.dtype, gate_up_scale_E2I: torch.Tensor | None = None,
              down_scale_ED: torch.Tensor | None = None,
              gate_up_adapter: ExpertAdapter | None = None,
              down_adapter: ExpertAdapter | None = None,
              kernel: bool = False) -> torch.Tensor:
    """Route each token to its K experts, two grouped GEMMs in `dtype` (int8 weights where
    scales are given; each with its LoRA adapter's update where one is given) with each pair's
    routing weight applied between them, and sum its K
    outputs (in float32, deterministic: no atomics, as transformers' un-permute and sum). The
    row gather and the sum are each other's backward: a gather and a float32 sum over K
    (model/rows.py: its torch expression, or with `kernel` its op, the compiled dispatch's), and a
    gather by token, where indexing's backward would scatter-add."""
    K = idx_TK.shape[1]
    E = gate_up_E2ID.shape[0]
    expert_P = idx_TK.reshape(-1)
    order_P = torch.argsort(expert_P, stable=True)  # pairs grouped by expert
    token_P = order_P // K
    ones = torch.ones_like(expert_P, dtype=torch.int32)
    per_expert_E = torch.zeros(E, dtype=torch.int32, device=x_TD.device).index_add_(0, expert_P, ones)
    offs_E = per_expert_E.cumsum(0, dtype=torch.int32)
    inverse_P = torch.empty_like(order_P)
    inverse_P[order_P] = torch.arange(order_P.numel(), device=order_P.device)
    rows_PD = _RouteRows.apply(x_TD.to(dtype), token_P, inverse_P, K, kernel)
    gate_up_P2I = _project(rows_PD, gate_up_E2ID, gate_up_scale_E2I, offs_E, dtype,
                           gate_up_adapter)
    h_PI = gate(gate_up_P2I)
    # The routing weight scales the down projection's input, not its output (the same product,
    # the projection being linear without bias): its gradient then sums over I, not D.
    h_PI = h_PI * w_TK.reshape(-1)[order_P].unsqueeze(-1).to(h_PI.dtype)
    out_PD = _project(h_PI, down_EDI, down_scale_ED, offs_E, dtype, down_adapter)
    return _CombineRows.apply(out_PD, inverse_P, token_P, K, kernel, x_TD.dtype)


def _silu_gate(gate_up_P2I: torch.Tensor) -> torch.Tensor:
    gate_PI, up_PI = gate_up_P2I.chunk(2, dim=-1)
    return F.silu(gate_PI) * up_PI


@functools.cache
def _compiled_silu_dispatch() -> Callable:
    """`_dispatch` with the SiLU gate, compiled once for every layer (tensors are its only
    inputs, so the 40 experts modules of a model share one graph)."""
    def silu_dispatch(x_TD, idx_TK, w_TK, gate_up_E2ID, down_EDI, dtype, gate_up_scale_E2I,
                      down_scale_ED, gate_up_adapter, down_adapter):
        return _dispatch(x_TD, idx_TK, w_TK, gate_up_E2ID, down_EDI, _silu_gate, dtype,
                         gate_up_scale_E2I, down_scale_ED, gate_up_adapter, down_adapter,
                         kernel=True)
    return torch.compile(silu_dispatch, dynamic=True)


def _silu_gated(experts) -> bool:
    """Whether `experts` gates with transformers' default SiLU(gate) * up (a version without
    that default, or another activation, runs the eager dispatch)."""
    return _silu_gated_classes(type(experts), type(experts.act_fn))


@functools.cache
def _silu_gated_classes(experts_cls: type, act_cls: type) -> bool:
    from transformers import activations
    from transformers.integrations import moe

    default = getattr(moe, "_default_apply_gate", None)
    silu = tuple(c for c in (getattr(activations, "SiLUActivation", None), torch.nn.SiLU) if c)
    return (default is not None and issubclass(act_cls, silu)
            and getattr(experts_cls, "_apply_gate", None) is default)


def _compute_dtype(experts, hidden_states: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype; for int8 weights outside autocast, the hidden states' dtype."""
    dtype = _autocast_dtype(hidden_states)
    if dtype is None and scales(experts)[0] is not None:
        return hidden_states.dtype
    return dtype


Adapters = dict[str, ExpertAdapter]
"""LoRA factors by the name of the expert weight they adapt (`gate_up_proj`, `down_proj`)."""


def takes_adapters(experts: torch.nn.Module) -> bool:
    """Whether `experts` runs vlpack's dispatch, so that its forward takes LoRA factors
    (`adapters=`) instead of reading adapted weights: vlpack's implementation set on its config
    and the plain layout."""
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    return impl in (IMPLEMENTATION, COMPILED) and _plain_layout(experts)


def vlpack_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor,
                           adapters: Adapters | None = None) -> torch.Tensor:
    """The experts forward of `self` (a transformers experts module with concatenated gate/up
    weights [E, 2I, D] and down weights [E, D, I], in int8 with row scales under
    `model.frozen_dtype=int8`, model/quant.py): `_dispatch` in the autocast dtype, or outside
    autocast in the hidden states' dtype (so a float32 `vlpack check` runs this path too), with
    the LoRA factors `adapters` (model/lora.py passes them); another layout runs transformers'
    grouped_mm."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    adapters = adapters or {}
    if not _plain_layout(self):
        assert scales(self)[0] is None, "int8 experts need the plain layout"
        assert not adapters, "LoRA factors need the plain layout (lora.py checks takes_adapters)"
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    dtype = _compute_dtype(self, hidden_states) or hidden_states.dtype
    return _dispatch(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                     self.down_proj, self._apply_gate, dtype, *scales(self),
                     adapters.get("gate_up_proj"), adapters.get("down_proj"))


def vlpack_experts_forward_compiled(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                    top_k_weights: torch.Tensor,
                                    adapters: Adapters | None = None) -> torch.Tensor:
    """`vlpack_experts_forward` with its dispatch compiled (inductor fuses the gathers, the
    casts, the weighted gate and the sum around the grouped GEMMs): the SiLU-gated experts
    of the Qwen MoE families under autocast; any other gate, or no autocast, runs
    `vlpack_experts_forward`."""
    dtype = _autocast_dtype(hidden_states)
    if dtype is None or not _plain_layout(self) or not _silu_gated(self):
        return vlpack_experts_forward(self, hidden_states, top_k_index, top_k_weights, adapters)
    adapters = adapters or {}
    if not torch.compiler.is_compiling():  # marks are for the compiled call below
        for routing_TK in (top_k_index, top_k_weights):
            torch._dynamo.mark_static(routing_TK, 1)
        rows.check_kernel(hidden_states.device, top_k_index.shape[1])
    with torch.autocast(hidden_states.device.type, enabled=False):  # casts are explicit
        return _compiled_silu_dispatch()(hidden_states, top_k_index, top_k_weights,
                                         self.gate_up_proj, self.down_proj, dtype, *scales(self),
                                         adapters.get("gate_up_proj"), adapters.get("down_proj"))


@functools.cache
def register() -> str:
    """Register `vlpack_experts_forward` with transformers' ExpertsInterface (once); returns
    its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, vlpack_experts_forward)
    ExpertsInterface.register(COMPILED, vlpack_experts_forward_compiled)
    return IMPLEMENTATION
