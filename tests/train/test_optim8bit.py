"""`optim.name=adamw8bit` (torchao's AdamW8bit): its state is the bytes the memory plan counts,
and its steps stay within the 8-bit moments' error of torch's AdamW. torchao is not a dev
dependency (transformers imports it in every process where it is installed): CI installs it
last and runs this file with test_quant.py; elsewhere it is skipped."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from vlpack.config import OptimConfig
from vlpack.train.optim import build_optimizer, build_scheduler
from vlpack.train.setup import memory

pytest.importorskip("torchao.optim", reason="torchao is installed in CI's last step only "
                    "(.ci/run): pip install torchao to run this file")


def _toy() -> nn.Module:
    """Linear(64, 128) + Linear(128, 16): a 8,192-value weight (quantized: at least 4,096
    values, 32 whole blocks), a 128-value bias and a 2,048-value weight (float32 moments:
    whole blocks, but under 4,096 values)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 16, bias=False))


def _train(name: str, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _toy()
    cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, warmup_steps=0)
    opt = build_optimizer(model.parameters(), cfg, device_type="cpu")
    sched = build_scheduler(opt, cfg, 10)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
        sched.step()
    return model, opt


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's moments: an 8-bit state's codes, block scales and code table, a
    plain tensor's own (the step counters left out, as the plan leaves them)."""
    total = 0
    for state in opt.state.values():
        for key, t in state.items():
            if key == "step":
                continue
            parts = [t.codes, t.scale, t.qmap] if hasattr(t, "codes") else [t]
            total += sum(x.numel() * x.element_size() for x in parts)
    return total


def test_adamw8bit_state_is_the_planned_bytes() -> None:
    """After one step: the 8,192-value weight keeps 2 · (8,192 codes + 4 · 32 scale bytes +
    4 · 256 table bytes) = 18,688 bytes, the bias 8 · 128 = 1,024 and the small weight
    8 · 2,048 = 16,384: 36,096, the plan's figure (float32 AdamW: 8 · 10,368 = 82,944)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    model, opt = _train("adamw8bit", 1)
    assert isinstance(opt.state[model[0].weight]["exp_avg"], OptimState8bit)
    assert _state_bytes(opt) == 36_096
    assert memory.plan(model, None, world_size=1, optimizer="adamw8bit").optimizer == 36_096
    assert memory.plan(model, None, world_size=1).optimizer == 82_944
    assert _state_bytes(_train("adamw", 1)[1]) == 82_944


def test_adamw8bit_steps_follow_adamw() -> None:
    """3 steps at lr 1e-2: every parameter moves (by up to 3 · lr), and ends within 0.1 · lr per
    step of torch's AdamW's (8-bit moments: each Adam step is lr · m̂ / √v̂ with both moments
    rounded to a 256-entry code per value)."""
    ref, _ = _train("adamw", 3)
    got, _ = _train("adamw8bit", 3)
    for a, b, init in zip(ref.parameters(), got.parameters(), _toy().parameters(), strict=True):
        assert (a - init).abs().max() > 1e-2
        assert (a - b).abs().max() <= 3 * 0.1 * 1e-2


def test_adamw8bit_trains_and_resumes_exactly(tmp_path) -> None:
    """`vlpack train tiny optim.name=adamw8bit`: 3 steps straight equal 2 steps, a stop, a
    resume from the checkpoint (the 8-bit moments saved and restored) and a third step; the
    metrics' lr is a number (torchao holds each group's rate as a tensor)."""
    from tests.helpers import CPU, losses, small_cfg
    from vlpack.train.trainer import Trainer

    args = ("train.max_steps=3", "optim.name=adamw8bit")
    Trainer(small_cfg(tmp_path / "a", *args), CPU).fit()
    Trainer(small_cfg(tmp_path / "b", *args, "train.stop_after=2"), CPU).fit()
    Trainer(small_cfg(tmp_path / "b", *args), CPU).fit()
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 3 and a == b[-3:], (a, b)
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r["lr"], float) for r in rows if "lr" in r)
