"""train/setup/prepare.py: one preparation, resolved once, applied in one order."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.helpers import CPU
from vlpack.config import load_config
from vlpack.model.build import meta_model
from vlpack.train.setup.prepare import STEPS, Preparation, preparation, prepare

TRAIN = Path(__file__).resolve().parents[3] / "src" / "vlpack" / "train"


def test_the_order_is_written_once() -> None:
    """LoRA, freezing, the held dtypes and the int8 experts are applied in `prepare` alone."""
    call = re.compile(r"\b(hold_parameters|apply_lora|freeze|quantize_experts)\(")
    sites = [f"{f.relative_to(TRAIN)}: {line.strip()}" for f in sorted(TRAIN.rglob("*.py"))
             for line in f.read_text().splitlines()
             if call.search(line) and not line.lstrip().startswith("def ")]
    assert sites and all(s.startswith("setup/prepare.py: ") for s in sites), sites
    assert STEPS == ("lora", "freeze", "hold", "int8", "checkpoint", "compile", "fsdp")


def test_a_run_resolves_its_preparation() -> None:
    """bf16 autocast with a LoRA base and a frozen vision tower: frozen matmul weights in bf16,
    random weights drawn in bf16; the memory plan's recompute share joins later."""
    cfg = load_config("tiny", ["model.dtype=bfloat16", "model.lora.rank=4",
                               "model.freeze_vision=true", "model.compile=true"])
    p = preparation(cfg, CPU)
    assert (p.autocast, p.frozen_dtype, p.build_dtype) == (torch.bfloat16,) * 3
    assert p.lora is cfg.model.lora and p.freeze_vision and p.freezes
    assert not (p.sharded or p.host_build or p.int8_experts)
    assert p.compile_scope == cfg.model.compile_scope and p.param_dtype == torch.bfloat16
    assert p.recompute_share == 0.0
    float32 = preparation(load_config("tiny", ["model.dtype=bfloat16",
                                               "model.frozen_dtype=float32"]), CPU)
    assert (float32.frozen_dtype, float32.build_dtype, float32.freezes) == (None, torch.float32,
                                                                           False)


def test_prepare_runs_the_steps_asked_for() -> None:
    """`last="lora"` adds the adapters and leaves the rest training; `first="freeze"` then
    freezes the vision tower, its adapters with it, and holds the frozen weights in bf16."""
    cfg = load_config("tiny", ["model.lora.rank=4", "model.lora.vision=true"])
    p = Preparation(lora=cfg.model.lora, freeze_vision=True, frozen_dtype=torch.bfloat16)
    model = meta_model("tiny-qwen3_vl")
    prepare(model, p, last="lora", shapes=True)
    visual = [n for n, q in model.named_parameters() if n.startswith("model.visual.")
              and "lora_" in n and q.requires_grad]
    assert visual and all(q.dtype == torch.float32 for q in model.parameters())
    prepare(model, p, first="freeze", last="hold", shapes=True)
    assert not any(q.requires_grad for n, q in model.named_parameters()
                   if n.startswith("model.visual.") and "merger" not in n)
    assert any(q.dtype == torch.bfloat16 for q in model.parameters())
    assert all(q.dtype == torch.float32 for q in model.parameters() if q.requires_grad)
