"""The optimizer's parameter groups (per-part learning rates) and the warmup of the schedule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlpack.config import OptimConfig, load_config
from vlpack.train.optim import build_optimizer, build_scheduler, describe, own_rates, warmup_steps
from vlpack.train.setup.module import module_groups


def _model() -> nn.Module:
    """The module layout of a Qwen-VL model: model.visual (blocks + merger),
    model.language_model, lm_head."""
    torch.manual_seed(0)
    m = nn.Module()
    m.model = nn.Module()
    m.model.visual = nn.Module()
    m.model.visual.blocks = nn.Linear(2, 2)  # weight decays, bias does not
    m.model.visual.merger = nn.Linear(2, 2)
    m.model.language_model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.LayerNorm(2))
    m.lm_head = nn.Linear(2, 3, bias=False)
    return m


def _rate_of(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, tuple[float, float]]:
    group = {id(p): g for g in opt.param_groups for p in g["params"]}
    return {n: (group[id(p)]["lr"], group[id(p)]["weight_decay"]) for n, p in model.named_parameters()}


def test_per_part_learning_rates_land_in_the_groups() -> None:
    model = _model()
    cfg = OptimConfig(lr=1e-4, lr_vision=1e-6, lr_merger=1e-5, weight_decay=0.1, warmup_steps=4)
    opt = build_optimizer(model.parameters(), cfg, device_type="cpu", parts=module_groups(model))
    assert _rate_of(opt, model) == {
        "model.visual.blocks.weight": (1e-6, 0.1), "model.visual.blocks.bias": (1e-6, 0.0),
        "model.visual.merger.weight": (1e-5, 0.1), "model.visual.merger.bias": (1e-5, 0.0),
        "model.language_model.0.weight": (1e-4, 0.1), "model.language_model.1.weight": (1e-4, 0.0),
        "model.language_model.1.bias": (1e-4, 0.0), "lm_head.weight": (1e-4, 0.1)}
    assert opt.param_groups[0]["lr"] == 1e-4  # optim.lr's group first: the metrics' lr column
    build_scheduler(opt, cfg, total_steps=20)  # the warmup scales every part alike
    assert sorted({round(g["lr"] / g["initial_lr"], 12) for g in opt.param_groups}) == [0.25]


def test_own_rates_name_the_trained_parts_with_their_own_rate() -> None:
    """The rates the metrics and the start-up line show beside `lr`: a part with its own
    `optim.lr_<part>` that has parameters to train (a frozen vision tower has none)."""
    model = _model()
    cfg = OptimConfig(lr=1e-4, lr_vision=1e-6, lr_merger=1e-5)
    assert own_rates(cfg, module_groups(model)) == {"lr_vision": 1e-6, "lr_merger": 1e-5}
    for p in model.model.visual.blocks.parameters():
        p.requires_grad_(False)
    assert own_rates(cfg, module_groups(model)) == {"lr_merger": 1e-5}
    assert own_rates(OptimConfig(lr=1e-4), module_groups(model)) == {}


def test_without_per_part_rates_the_groups_are_decay_and_no_decay() -> None:
    model = _model()
    opt = build_optimizer(model.parameters(), OptimConfig(lr=1e-4, weight_decay=0.1), device_type="cpu",
                          parts=module_groups(model))
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [
        (1e-4, 0.1, 4), (1e-4, 0.0, 4)]


def test_per_part_rates_need_the_parts() -> None:
    with pytest.raises(ValueError, match=r"need the model's parts: pass parts=module_groups"):
        build_optimizer(_model().parameters(), OptimConfig(lr_llm=1e-5), device_type="cpu")


def test_warmup_ratio_replaces_warmup_steps() -> None:
    assert warmup_steps(OptimConfig(warmup_steps=5), 40) == 5
    assert warmup_steps(OptimConfig(warmup_steps=5, warmup_ratio=0.1), 40) == 4
    assert warmup_steps(OptimConfig(warmup_ratio=0.03), 1000) == 30
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, warmup_ratio=0.1), total_steps=40)
    rates = []
    for _ in range(4):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates == [0.25, 0.5, 0.75, 1.0]


def test_the_schedule_line_says_what_a_run_shorter_than_its_warmup_does() -> None:
    """A 3-step trial run of a recipe with 5 warm-up steps climbs to 3/5 of each rate and never
    decays (the rates the scheduler gives, read against the line)."""
    cfg = OptimConfig(lr=1.0, warmup_steps=5)
    assert describe(cfg, {}, 3).endswith(
        "; warmup 5 steps, the whole run of 3, reaching 3/5 of each rate, no decay "
        "(optim.warmup_steps below train.max_steps gives the cosine decay)")
    assert describe(cfg, {}, 40).endswith("; warmup 5 steps, then cosine to 0.1 × each rate at step 40")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, cfg, total_steps=3)
    rates = []
    for _ in range(3):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates == pytest.approx([0.2, 0.4, 0.6])


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lr_vision=0", r"optim.lr_vision must be > 0"),
    ("optim.warmup_ratio=1", r"optim.warmup_ratio must be in \[0, 1\), got 1.0"),
    ("optim.name=adam8", r"optim.name='adam8' is not one of adamw, adamw8bit"),
])
def test_bad_values_are_named(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config("tiny", [override])


@pytest.mark.parametrize(("overrides", "lr"), [
    ([], 1e-5), (["model.lora.rank=8"], 2e-4), (["model.lora.rank=8", "optim.lr=3e-4"], 3e-4)])
def test_fine_tuning_defaults(overrides: list[str], lr: float) -> None:
    optim = load_config(None, overrides).optim
    assert (optim.lr, optim.betas) == (lr, (0.9, 0.999))


@pytest.mark.parametrize("recipe", ["qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-9b",
                                    "qwen3.5-35b-a3b"])
def test_a_recipe_with_lora_switched_on_gets_the_lora_rate(recipe: str) -> None:
    """The full fine-tuning recipes leave the rate to the default, so `model.lora.rank=N` on
    one of them trains at LoRA's 2e-4, not at full fine-tuning's 1e-5."""
    assert load_config(recipe).optim.lr == 1e-5
    assert load_config(recipe, ["model.lora.rank=8"]).optim.lr == 2e-4


def test_adamw8bit_without_torchao_names_the_install(monkeypatch) -> None:
    """`optim.name=adamw8bit` where torchao cannot be imported: a ValueError naming
    `pip install torchao` (tests/train/test_optim8bit.py runs it where torchao is installed)."""
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(ValueError, match=r"optim\.name=adamw8bit needs torchao: pip install "):
        build_optimizer(_model().parameters(), OptimConfig(name="adamw8bit"), device_type="cpu")
