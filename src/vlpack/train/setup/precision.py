"""Which dtype each parameter is held in.

Training autocasts to bf16 on a GPU over float32 master weights. A parameter that gets no
gradient (the base of a LoRA run, a `model.freeze_*` part) needs no master: where autocast would
cast it to bf16 at every use anyway (the weights and biases of linear layers, the routed
experts' 3-D weights, the MoE routers' weights, which transformers applies with `F.linear`),
vlpack holds it in bf16 from the start. The arithmetic is unchanged
(autocast's cast of a bf16 tensor is a no-op; tests/train/setup/test_precision.py shows the loss and every
gradient bit for bit equal) and the frozen base takes half the memory: the 35.1 B parameters of
Qwen3.5-35B-A3B take 65 GiB instead of 131.

On one device, a frozen input embedding built in that dtype (random weights drawn in it, a folder
stored in it) is held in it too, and its lookup cast to float32, the dtype of the residual stream
it starts (`HeldEmbedding`): the values are those the float32 table would hold, so this too
changes no result, and saves half of a table that is 1.9 GiB in float32 for Qwen3.5-35B-A3B. A
linear weight tied to it goes with it (autocast casts it to bf16 at every use). Under FSDP2 the
embedding stays float32: it is sharded, and FSDP2 gathers it in bf16, which starts a bf16
residual stream there.

Everything else stays float32: trainable parameters (their AdamW masters), an embedding built in
float32 (rounding it would change the residual stream), the vision tower's position embedding,
norms, convolutions and the Gated-DeltaNet's A_log and dt_bias.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vlpack.model.seams import classes_of

STORED = {torch.bfloat16: "BF16", torch.float16: "F16"}
"""The safetensors name of each dtype a folder's weights may be built in exactly."""


def frozen_matmul_dtype(setting: str, autocast: torch.dtype | None) -> torch.dtype | None:
    """The dtype frozen matmul weights are held in, by `model.frozen_dtype` (`setting`): `auto`
    (and `int8`, for all but the routed experts) follows the autocast dtype (bf16 on a GPU),
    `float32` keeps them float32 (None: no cast)."""
    if setting == "float32" or autocast is None:
        return None
    return autocast


def matmul_parameters(model: nn.Module) -> set[str]:
    """Names of the parameters that autocast casts at every use: the weight and bias of each
    nn.Linear (a LoRA layer's base included), the routed experts' 3-D weights and, in a whole
    model (its config names the family), each MoE router's weight (transformers' top-k routers
    apply it with `F.linear`), less any parameter an embedding shares (tied word embeddings)."""
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters(recurse=False)}
    whole = getattr(getattr(model, "config", None), "model_type", None) is not None
    router = classes_of(model).router if whole else None
    applied = (nn.Linear,) if router is None else (nn.Linear, router)
    out = set()
    for mod_name, m in model.named_modules():
        for leaf, p in m.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            applied_weight = isinstance(m, applied) and leaf in ("weight", "bias")
            expert = ".experts" in f".{mod_name}" and p.ndim == 3
            if (applied_weight or expert) and id(p) not in embedded:
                out.add(name)
    return out


class HeldEmbedding(nn.Embedding):
    """A frozen input embedding held in the compute dtype (`hold_parameters`): its lookup is
    cast to float32, the residual stream's dtype."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input).to(torch.float32)


def input_embedding(model: nn.Module) -> nn.Module | None:
    """`model`'s input embedding (transformers' `get_input_embeddings`), None where it has none."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return emb if isinstance(emb, nn.Module) else None


def _held_embedding(model: nn.Module, low: torch.dtype | None, embedding: bool
                    ) -> nn.Embedding | None:
    """`model`'s input embedding where `hold_parameters` holds it in `low`: frozen, a plain
    nn.Embedding (or already held) and built in `low`, so holding it rounds nothing."""
    emb = input_embedding(model) if embedding and low is not None else None
    if type(emb) not in (nn.Embedding, HeldEmbedding):
        return None
    if emb.weight.requires_grad or emb.weight.dtype != low:
        return None
    return emb


def hold_parameters(model: nn.Module, low: torch.dtype | None, *, embedding: bool = True) -> int:
    """Hold each frozen matmul parameter of `model` in `low`, with `embedding` (one device, not
    FSDP2) its input embedding too where it is frozen and built in `low` (`HeldEmbedding`), and
    every other parameter in float32, in place (meta tensors too); returns the number of
    parameters held in `low`. `requires_grad` decides, so it runs after LoRA and freezing
    (train/setup/prepare.py)."""
    matmul = matmul_parameters(model) if low is not None else set()
    emb = _held_embedding(model, low, embedding)
    if emb is not None:
        emb.__class__ = HeldEmbedding
        matmul |= {n for n, p in model.named_parameters() if p is emb.weight}
    held = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            want = low if (name in matmul and not p.requires_grad) else torch.float32
            if p.dtype != want and p.is_floating_point():
                p.data = p.data.to(want)
            held += p.numel() if want == low else 0
    return held


def stored_in(folder: Path, dtype: torch.dtype) -> bool:
    """Whether every tensor in the folder's *.safetensors files is stored in `dtype` (read from
    the files' headers, no weights): then a build in `dtype` loads them exactly."""
    from safetensors import safe_open

    want = STORED.get(dtype)
    files = sorted(folder.glob("*.safetensors"))
    if want is None or not files:
        return False
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names = fh.keys()
            if any(fh.get_slice(n).get_dtype() != want for n in names):
                return False
    return True


def build_dtype(name: str, low: torch.dtype | None) -> torch.dtype:
    """The dtype to build `name` (a preset or a folder) in: `low` when frozen weights are held
    in it and no stored weight is rounded by building in it (random weights, drawn in `low`, or
    a folder stored in `low`), else float32. `hold_parameters` then brings every other
    parameter to float32. Random weights drawn in bf16 are not the float32 draw rounded: such a
    run starts from other weights than the same run with `model.frozen_dtype=float32`."""
    from vlpack.model.build import folder_has_weights

    if low is None:
        return torch.float32
    folder = Path(name)
    if folder.is_dir() and folder_has_weights(folder) and not stored_in(folder, low):
        return torch.float32
    return low
