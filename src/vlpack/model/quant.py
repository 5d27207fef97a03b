"""The routed experts' frozen weights in int8 (`model.frozen_dtype=int8`), weight-only.

The routed experts hold 32.2 B of Qwen3.5-35B-A3B's 35.1 B parameters; in bf16 they take 60 GiB,
in int8 30 GiB, which puts a LoRA run of the whole model on a 48 GB GPU (docs/training.md). Each
frozen expert weight is replaced by an int8 tensor of the same shape and a float32 scale per
output row: symmetric, `scale = max|row| / 127.5`, `q = clamp(round(w / scale), -128, 127)`.
That is torchao's `choose_qparams_affine` + `quantize_affine` with `MappingType.SYMMETRIC` and a
block of one row, bit for bit (tests/model/test_quant.py holds it against torchao). torchao's
`quantize_` converts `nn.Linear` weights; the experts' weights are 3-D parameters run by a
grouped GEMM, so vlpack stores them itself and model/experts.py dequantizes one weight at a
time to the compute dtype as it runs it (`q · scale` in float32, stored in that dtype), again in
backward instead of keeping the dequantized copy (`int8_grouped_mm`, one opaque op, eager and
compiled).

Only weights that get no gradient are quantized (a LoRA run's base, `model.freeze_llm`); the
dense projections, the shared expert and the vision tower keep the `auto` rule (bf16 on a GPU).
Packed and unpacked forwards run the same int8 weights, so packed ≡ unpacked holds unchanged;
the quantization error itself is the price of the memory (`vlpack check` runs float32 weights).

Legend: E = experts, O = output rows of a projection, X = its input width.
"""

from __future__ import annotations

import torch
from torch import nn

WEIGHTS = ("gate_up_proj", "down_proj")
"""The experts module's 3-D weights, each [E, O, X] (out = x @ w[e].T)."""
SCALE = "_scale"
"""Suffix of the float32 [E, O] scale beside each int8 weight: a buffer outside the state dict
(a checkpoint holds the trained parameters only; a resume quantizes the base again, and an
export merges into the base as stored)."""
QMIN, QMAX = -128, 127


def quantize_rows(w_EOX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q_EOX int8, scale_EO float32)."""
    w = w_EOX.float()
    scale_EO = (w.abs().amax(-1) / ((QMAX - QMIN) / 2)).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w * (1.0 / scale_EO).unsqueeze(-1)).clamp(QMIN, QMAX)
    return q.to(torch.int8), scale_EO


def dequantize(q_EOX: torch.Tensor, scale_EO: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight `q_EOX` stands for, in `dtype`: each int8 code times its row's float32 scale,
    computed in float32 and stored in `dtype`, in one pass that reads the codes and writes the
    weight (3 bytes a parameter in bf16; a cast and then a scale in place move 7). Bit for bit
    the cast-then-scale. Not differentiable: the weight is frozen."""
    assert q_EOX.dtype == torch.int8, q_EOX.dtype
    out_EOX = torch.empty(q_EOX.shape, dtype=dtype, device=q_EOX.device)
    return torch.mul(q_EOX, scale_EO.unsqueeze(-1), out=out_EOX)


def scales(experts: nn.Module) -> tuple[torch.Tensor | None, ...]:
    """The scales of `experts`' weights in WEIGHTS order (None for a weight not in int8)."""
    return tuple(getattr(experts, name + SCALE, None) for name in WEIGHTS)


def scale_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every int8 weight's scale in `model` (for the memory plan: they are no parameters)."""
    return [b for name, b in model.named_buffers() if name.endswith(tuple(w + SCALE for w in WEIGHTS))]


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] == "experts"
            and all(isinstance(getattr(m, w, None), nn.Parameter) for w in WEIGHTS)]


def quantize_experts(model: nn.Module, device: torch.device, *, model_name: str = "the model") -> int:
    """Replace each frozen routed-expert weight of `model` by int8 on `device` and its scale,
    quantized expert by expert (the float weight is freed as its int8 copy replaces it); on the
    meta device, by shape only (the memory plan). Returns the number of weights quantized; a
    ValueError when `model` has no routed experts, or when they train."""
    modules = _experts_modules(model)
    if not modules:
        raise ValueError(f"model.frozen_dtype=int8 holds the routed experts' weights in int8, but "
                         f"{model_name} has no routed experts: use model.frozen_dtype=auto")
    if any(getattr(m, w).requires_grad for m in modules for w in WEIGHTS):
        raise ValueError("model.frozen_dtype=int8 quantizes frozen expert weights, but this run "
                         "trains them: train LoRA adapters (model.lora.rank=16, "
                         "model.lora.experts=false) or freeze the LLM, or use "
                         "model.frozen_dtype=auto")
    done = 0
    with torch.no_grad():
        for m in modules:
            for name in WEIGHTS:
                w = getattr(m, name)
                if w.dtype == torch.int8:
                    continue
                shapes_only = device.type == "meta" or w.device.type == "meta"
                to = torch.device("meta") if shapes_only else device
                q = torch.empty(w.shape, dtype=torch.int8, device=to)
                s = torch.empty(w.shape[:-1], dtype=torch.float32, device=to)
                for e in range(0 if shapes_only else w.shape[0]):  # one expert at a time
                    q[e], s[e] = quantize_rows(w[e].to(device))  # bounds the float32 copy
                setattr(m, name, nn.Parameter(q, requires_grad=False))
                m.register_buffer(name + SCALE, s, persistent=False)
                done += 1
    return done
