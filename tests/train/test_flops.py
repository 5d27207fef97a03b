"""The FLOPs of a training step (train/flops.py): what a frozen weight costs, counted after
freezing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, small_cfg
from vlpack.config import LoraConfig
from vlpack.model.build import build_model
from vlpack.train.flops import flop_model
from vlpack.train.loop import Trainer


def test_a_frozen_weight_costs_four_flops_and_a_frozen_tower_two() -> None:
    """FLOPs per token of the LLM's weights: 6 per parameter when they train; with LoRA the base
    costs 4 (no weight gradient) and each adapter 6; the frozen vision tower (no gradient flows
    into it) costs 2 per parameter and its attention one pass instead of three."""
    from vlpack.model import lora

    full = flop_model(build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu")[0])
    model = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu")[0]
    lora.apply_lora(model, LoraConfig(rank=4))
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    adapter_params = sum(4 * (m.in_features + m.out_features) for m in adapted)
    ft = flop_model(model)
    assert ft.text_per_token == pytest.approx(full.text_per_token * 4 / 6 + 6 * adapter_params)
    assert ft.vision_per_patch == pytest.approx(full.vision_per_patch / 3)
    assert (full.vision_attn_passes, ft.vision_attn_passes) == (3, 1)


def test_a_step_reports_the_frozen_aware_mfu_inputs(tmp_path: Path) -> None:
    """The trainer counts FLOPs after freezing: a frozen vision tower costs less than a training
    one on the same batch."""
    a = Trainer(small_cfg(tmp_path / "a"), CPU)
    b = Trainer(small_cfg(tmp_path / "b", "model.freeze_vision=true", "model.freeze_merger=true"),
                CPU)
    assert b.flops.vision_per_patch == pytest.approx(a.flops.vision_per_patch / 3)
