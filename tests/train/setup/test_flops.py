"""The FLOPs of a training step (train/setup/flops.py): what a frozen weight costs, counted after
freezing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, small_cfg
from vlpack.config import LoraConfig
from vlpack.model.build import build_model
from vlpack.train.setup.flops import flop_model
from vlpack.train.trainer import Trainer


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


def test_recomputed_flops_by_hand() -> None:
    """tiny-qwen3_vl's text layer (h 64, 4 heads of 16, 2 kv heads, MLP 128, no biases) holds
    64·64 + 2·64·32 + 64·64 + 3·64·128 = 36,864 linear weights: a recomputed layer performs
    2 · 36,864 = 73,728 FLOPs per token again, and its attention 2·2·64·L²/2 per sample of L
    tokens. With share 0.5 the first of the 2 layers recomputes; the vision tower trains (full
    fine-tuning), so its first of 2 blocks recomputes too. Without checkpointing nothing does."""
    from vlpack.model.recompute import enable_activation_checkpointing

    model = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu")[0]
    assert flop_model(model).recomputed_flops([3, 5], 10, [4, 6]) == 0.0
    enable_activation_checkpointing(model, 0.5)
    f = flop_model(model)
    assert (f.recomputed_per_token, f.recomputed_attn_layers, f.recomputed_vision_blocks) == (
        73_728, 1, 1)
    block = model.model.visual.blocks[0]
    per_patch = 2 * sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    vis = f.vision_attn_dim
    assert f.recomputed_flops([3, 5], 10, [4, 6]) == pytest.approx(
        73_728 * 8 + 2 * 2 * 64 * (9 + 25) / 2 + per_patch * 10 + 2 * 2 * vis * (16 + 36))


def test_the_metrics_say_what_share_of_the_flops_recomputes(tmp_path: Path) -> None:
    """A step's row: recompute_flops_share = recomputed / (counted + recomputed), from the same
    batches MFU counts; 0 without activation checkpointing."""
    import json

    for ac, positive in (("false", False), ("true", True)):
        out = tmp_path / ac
        trainer = Trainer(small_cfg(out, f"model.activation_checkpointing={ac}",
                                    "train.max_steps=1"), CPU)
        trainer.fit()
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        assert (row["recompute_flops_share"] > 0) == positive
        assert row["recompute_flops_share"] < 0.5


def test_a_frozen_tower_under_a_training_merger_recomputes_no_block() -> None:
    """With the tower frozen and its merger training, no gradient flows through the vision
    blocks: their checkpoints never recompute, and nothing is counted for them."""
    from vlpack.model.recompute import enable_activation_checkpointing
    from vlpack.train.setup.module import freeze

    model = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu")[0]
    freeze(model, vision=True, merger=False, llm=False)
    enable_activation_checkpointing(model, 1.0)
    f = flop_model(model)
    assert (f.recomputed_vision_blocks, f.recomputed_per_patch) == (0, 0.0)
    assert f.recomputed_attn_layers == 2
