"""Checkpoints: sharded torch.distributed.checkpoint saves, written atomically, and HF export.

Layout: `output_dir/checkpoints/step_00000020/` holds the DCP shards of model + optimizer, one
`trainer_rank{r}.pt` per rank (scheduler, RNG, data-loader position, counters) and a COMPLETE
marker. A save goes to `step_…​.tmp/` and is renamed only after every rank finished, so a kill
during a save leaves the previous checkpoint as the latest usable one.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from vlpack.train.parallel import DistInfo, barrier

MARKER = "COMPLETE"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `output_dir/checkpoints`, or None."""
    root = Path(output_dir) / "checkpoints"
    done = [p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).is_file()]
    return max(done, key=lambda p: p.name) if done else None


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    info: DistInfo,
    *,
    keep: int = 2,
) -> Path:
    """Save atomically; keep the newest `keep` checkpoints. Collective: every rank calls it."""
    root = Path(output_dir) / "checkpoints"
    final = _step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save({**trainer_state, "rng": rng_state()}, tmp / f"trainer_rank{info.rank}.pt")
    barrier(info)
    if info.is_main:
        (tmp / MARKER).write_text(json.dumps({"step": step, "world_size": info.world_size}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        old = sorted(p for p in root.glob("step_*") if (p / MARKER).is_file())
        for p in old[:-keep] if keep else []:
            shutil.rmtree(p, ignore_errors=True)
    barrier(info)
    return final


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> dict[str, Any]:
    """Restore model and optimizer in place; return this rank's trainer state (RNG restored)."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise ValueError(f"{path} is not a complete vlpack checkpoint (no {MARKER} marker)")
    saved_world = json.loads(marker.read_text())["world_size"]
    if saved_world != info.world_size:
        raise ValueError(
            f"{path} was saved by {saved_world} ranks but this run has {info.world_size}; resume "
            f"with the same number of processes, or start anew with train.resume=none"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = torch.load(path / f"trainer_rank{info.rank}.pt", weights_only=False)
    set_rng_state(trainer.pop("rng"))
    return trainer


def export_hf(
    model: torch.nn.Module, out_dir: str | Path, info: DistInfo, *, tokenizer=None, processor=None
) -> Path:
    """Write a HF folder (safetensors, config, tokenizer, image processor) that transformers
    loads and `vlpack train model.name=FOLDER` fine-tunes further. Collective."""
    out = Path(out_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, state_dict=full, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        if processor is not None:
            processor.save_pretrained(out)
    barrier(info)
    return out
