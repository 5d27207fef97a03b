"""The refactoring gate: the `tiny` recipe on CPU, fixed seed, 8 steps. Its losses and a
checksum of the final parameters are pinned as literals, so a change of mechanism (how the
boundaries reach the layers, how a seam is installed) that changes any arithmetic fails here.

A change that is MEANT to change the numbers re-pins them: run this file with
`VLPACK_PRINT_GOLDEN=1 pytest tests/test_golden_loss.py -s` and paste the printed values, and
say why in the commit message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tests.test_train import CPU
from vlpack.config import load_config
from vlpack.train.loop import Trainer

LOSSES = [11.891816557655039, 11.751545788770054, 11.59266744050267, 11.50473915658346,
          11.327744909347668, 11.120868336070668, 10.91054056534508, 10.757467534338128]
PARAM_SUM, PARAM_ABS_SUM = 1486.5412560201735, 171974.39406107142


def test_tiny_recipe_losses_and_parameters_are_unchanged(tmp_path: Path) -> None:
    cfg = load_config("tiny", ["train.max_steps=8", "train.save_every=0", "train.eval_every=0",
                               "data.eval_samples=0", "train.save_final=false",
                               "train.progress=false", f"train.output_dir={tmp_path}"])
    trainer = Trainer(cfg, CPU)
    trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    params = [p.detach().double() for p in trainer.model.parameters()]
    total = sum(float(p.sum()) for p in params)
    total_abs = sum(float(p.abs().sum()) for p in params)
    if os.environ.get("VLPACK_PRINT_GOLDEN"):
        print(f"LOSSES = {losses}\nPARAM_SUM, PARAM_ABS_SUM = {total!r}, {total_abs!r}")
    assert losses == LOSSES
    assert (total, total_abs) == (PARAM_SUM, PARAM_ABS_SUM)
    assert torch.get_default_dtype() == torch.float32
