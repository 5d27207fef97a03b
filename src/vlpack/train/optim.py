"""AdamW with per-part learning rates and the warmup + cosine learning-rate schedule.

`optim.name=adamw8bit` keeps both moments in 8 bits through torchao's `AdamW8bit` (blocks of
`BLOCK_SIZE` values share a float32 scale; train/setup/memory.py `moment_bytes` counts them)."""

from __future__ import annotations

import math

import torch

from vlpack.config import OptimConfig

BLOCK_SIZE = 256
"""Values per float32 scale of torchao's 8-bit moments (`AdamW8bit`'s default block size)."""

PARTS = ("vision", "merger", "llm")
"""The model parts that may have their own learning rate (`optim.lr_vision`, ...)."""


def part_lrs(cfg: OptimConfig) -> dict[str, float]:
    """The learning rate of each part: its own `optim.lr_<part>`, else `optim.lr`."""
    return {part: getattr(cfg, f"lr_{part}") or cfg.lr for part in PARTS}


def own_rates(cfg: OptimConfig, parts: dict[str, list[torch.nn.Parameter]]) -> dict[str, float]:
    """`{"lr_<part>": rate}` of each part with its own `optim.lr_<part>` and parameters to
    train (`parts`: `module_groups`), the rates the log and the metrics name beside `lr`."""
    return {f"lr_{part}": rate for part in PARTS
            if (rate := getattr(cfg, f"lr_{part}")) is not None
            and any(p.requires_grad for p in parts[part])}


def describe(cfg: OptimConfig, rates: dict[str, float], total_steps: int) -> str:
    """The start-up line naming the optimizer, every rate (`own_rates`) and the schedule."""
    named = ", ".join([f"lr {cfg.lr:.2e}", *(f"{k} {v:.2e}" for k, v in rates.items())])
    name = "AdamW (8-bit moments, torchao)" if cfg.name == "adamw8bit" else "AdamW"
    warmup = warmup_steps(cfg, total_steps)
    if warmup < total_steps:
        schedule = (f"warmup {warmup} steps, then cosine to {cfg.min_lr_ratio:g} × each rate at "
                    f"step {total_steps}")
    else:  # a run no longer than its warmup (a short trial run): the rates never decay
        reach = "" if warmup == total_steps else f", reaching {total_steps}/{warmup} of each rate"
        schedule = (f"warmup {warmup} steps, the whole run of {total_steps}{reach}, no decay "
                    "(optim.warmup_steps below train.max_steps gives the cosine decay)")
    return (f"vlpack: {name} {named}; weight decay {cfg.weight_decay:g} (none on norms and "
            f"biases); {schedule}")


def build_optimizer(params, cfg: OptimConfig, *, device_type: str,
                    parts: dict[str, list[torch.nn.Parameter]] | None = None
                    ) -> torch.optim.Optimizer:
    """AdamW over trainable params (`optim.name`: torch's, fused kernels on GPU; or torchao's
    AdamW8bit). Norms and biases get no decay.

    `parts` (`vlpack.train.setup.module.module_groups`: vision, merger, llm) gives each part's
    parameters `optim.lr_<part>`; parameters outside them keep `optim.lr`. Without per-part rates
    the groups are [decay, no decay], as a checkpoint of such a run holds them."""
    params = [p for p in params if p.requires_grad]
    lrs = part_lrs(cfg)
    if any(lr != cfg.lr for lr in lrs.values()):
        if parts is None:
            raise ValueError("optim.lr_vision / lr_merger / lr_llm need the model's parts: pass "
                             "parts=module_groups(model) to build_optimizer")
        lr_of = {id(p): lrs[part] for part in PARTS for p in parts[part]}
    else:
        lr_of = {}
    groups: dict[tuple[float, bool], list] = {}
    for base in (True, False):  # optim.lr's groups first: the metrics report the first's rate
        for decay in (True, False):  # decay groups first, as without per-part rates
            for p in params:
                lr = lr_of.get(id(p), cfg.lr)
                if (p.ndim >= 2) == decay and (lr == cfg.lr) == base:
                    groups.setdefault((lr, decay), []).append(p)
    param_groups = [{"params": ps, "lr": lr, "weight_decay": cfg.weight_decay if decay else 0.0}
                    for (lr, decay), ps in groups.items()]
    if cfg.name == "adamw8bit":
        return adamw8bit()(param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, block_size=BLOCK_SIZE)
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             fused=device_type == "cuda")


def adamw8bit() -> type[torch.optim.Optimizer]:
    """torchao's `AdamW8bit` class; a ValueError naming the install when torchao is missing."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ValueError("optim.name=adamw8bit needs torchao: pip install torchao (or "
                         "optim.name=adamw)") from e
    return AdamW8bit


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """`optim.warmup_ratio` of the run's steps (rounded) when set, else `optim.warmup_steps`."""
    if cfg.warmup_ratio is None:
        return cfg.warmup_steps
    return round(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warmup over
    `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                    done_steps: int = 0):
    """LambdaLR implementing `lr_factor` (the same factor on every parameter group's rate),
    `done_steps` optimizer steps into the schedule (then the groups hold `initial_lr`:
    `resumed_scheduler`)."""
    warmup = warmup_steps(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_factor(s, warmup=warmup, total=total_steps, min_ratio=cfg.min_lr_ratio),
        last_epoch=done_steps - 1,
    )


def group_settings(opt: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings (rate, initial rate, decay, betas, ...), no parameters:
    what `resumed_scheduler` puts back after a checkpoint's optimizer state is loaded."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def resumed_scheduler(opt: torch.optim.Optimizer, settings: list[dict], cfg: OptimConfig,
                      total_steps: int, done_steps: int):
    """The scheduler of a run resumed after `done_steps` optimizer steps, on an optimizer whose
    state a checkpoint has just loaded. The checkpoint's parameter groups carry the old run's
    settings; this run's (`settings`, from `group_settings` before the load) replace them, and
    the schedule is this run's (`optim.*`, `train.max_steps`), so a changed rate, decay or run
    length takes effect at the next step. With nothing changed the rates are the checkpoint's,
    bit for bit (the same factor times the same base)."""
    for group, own in zip(opt.param_groups, settings, strict=True):
        group.update(own)
    return build_scheduler(opt, cfg, total_steps, done_steps)
