"""Regional torch.compile: fuse the elementwise work around the matmuls.

A profile of the eager packed qwen3-vl-2b step (docs/benchmarks.md) spent about half of its
kernel time outside matmuls and attention: dtype casts, multiplies and adds, many of them in the
RMSNorms and the gated MLPs. Compiling those modules (and only those) lets inductor fuse them;
the decoder layers, the attention seams and the Gated-DeltaNet kernels stay eager, so the
boundary contract (cu_seqlens, positions) is untouched.

`dynamic=True`: packed bins have a different token count every step; one graph serves all.
"""

from __future__ import annotations

from torch import nn

COMPILED_SUFFIXES = ("RMSNorm", "MLP", "Mlp")
"""Class-name endings of the compiled modules: text and vision RMSNorms, dense and shared-expert
MLPs of every family (Qwen2-VL's vision `VisionMlp` included). Routed-expert blocks are left
eager: their token dispatch has data-dependent shapes."""


def compile_regions(model: nn.Module) -> list[str]:
    """Compile every norm and MLP module of `model` in place; return the compiled class names."""
    names: set[str] = set()
    for module in model.modules():
        cls = type(module).__name__
        if cls.endswith(COMPILED_SUFFIXES):
            module.compile(dynamic=True)
            names.add(cls)
    if not names:
        raise ValueError(
            f"model.compile found no RMSNorm or MLP module in {type(model).__name__}: "
            "set model.compile=false for this model"
        )
    return sorted(names)
