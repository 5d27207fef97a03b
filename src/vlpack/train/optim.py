"""AdamW and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from vlpack.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig, *, device_type: str) -> torch.optim.AdamW:
    """AdamW over trainable params; fused kernels on GPU. Norms and biases get no decay."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=device_type == "cuda",
    )


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warmup over
    `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """LambdaLR implementing `lr_factor`."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_factor(s, warmup=cfg.warmup_steps, total=total_steps, min_ratio=cfg.min_lr_ratio),
    )
