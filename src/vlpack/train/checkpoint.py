"""Checkpoints: sharded torch.distributed.checkpoint saves, written atomically.

Layout: `output_dir/checkpoints/step_00000020/` holds the DCP shards of model + optimizer, one
`trainer_rank{r}.pt` per rank (scheduler, RNG, data-loader position, counters) and a COMPLETE
marker (step, world size, run id). A save goes to `step_…​.tmp/` and is renamed only after every
rank finished, so a kill during a save leaves the previous checkpoint as the latest usable one.
Rotation deletes only checkpoints of the same run id: a run never deletes another run's. It runs
after the new checkpoint is written, or before it when the disk is too full for it: then the
checkpoints rotation would delete anyway go first, never the latest (the resume point).

A checkpoint holds the parameters that train, not the frozen ones (a LoRA run's base is 65 GiB
for Qwen3.5-35B-A3B, its adapters 0.1): a resumed run builds the frozen weights again from the
same `model.name` and seed, as the run itself did.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from vlpack.pickles import load_weights_only
from vlpack.train.parallel import Topology, all_reduce, barrier

MARKER = "COMPLETE"
HEADROOM = 1.1
"""A save starts only when the disk has this many times the checkpoint's size free."""

log = logging.getLogger(__name__)


class CheckpointSaveError(ValueError):
    """A checkpoint could not be written (disk full, write failed); nothing partial is left and
    the previous checkpoint stays the resume point. The message says how much space it needs."""


def _resume_point(output_dir: str | Path) -> str:
    """'; DIR stays the resume point' for a failed save's message ('' without a checkpoint)."""
    previous = latest_checkpoint(output_dir)
    return f"; {previous} stays the resume point" if previous else ""


def _reason(e: BaseException) -> str:
    """One line for a failed write: the exception's type and first line, without the
    tracebacks torch's CheckpointException carries (each rank's first failure, once)."""
    if isinstance(e, CheckpointException) and e.failures:
        return "; ".join(sorted({_reason(exc) for exc, _ in e.failures.values()}))
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _own_checkpoints(root: Path, run_id: str | None) -> list[Path]:
    """Complete checkpoints of run `run_id` under `root`, oldest first."""
    return sorted(p for p in root.glob("step_*")
                  if (p / MARKER).is_file() and marker(p).get("run_id") == run_id)


def _rotate(root: Path, run_id: str | None, keep: int) -> list[Path]:
    """Delete run `run_id`'s checkpoints but the newest `keep` (all kept for 0); never the
    latest complete one of the folder. Returns the deleted folders."""
    if not keep:
        return []
    latest = max((p for p in root.glob("step_*") if (p / MARKER).is_file()),
                 key=lambda p: p.name, default=None)
    own = _own_checkpoints(root, run_id)
    gone = [p for p in own[:max(len(own) - keep, 0)] if p != latest]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _tensor_bytes(tree) -> int:
    """Bytes of the tensors in a state dict on this rank (a DTensor's local shard only)."""
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_tensor_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        t = tree.to_local() if hasattr(tree, "to_local") else tree
        return t.numel() * t.element_size()
    return 0


def rng_state() -> dict[str, Any]:
    """Every generator's state in types `torch.load(weights_only=True)` reads (numpy's key as a
    list, not an array)."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (kind, key.tolist(), pos, has_gauss, cached),
             "python": random.getstate()}
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


def marker(path: Path) -> dict[str, Any]:
    """The COMPLETE marker of a checkpoint folder: step, world_size, run_id (None if older),
    the digest of the frozen parameters' names, the device type the run trained on and whether
    FSDP2 sharded it (where the frozen base was drawn: vlpack.train.export rebuilds it)."""
    return json.loads((path / MARKER).read_text())


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `output_dir/checkpoints`, or None."""
    root = Path(output_dir) / "checkpoints"
    done = [p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).is_file()]
    return max(done, key=lambda p: p.name) if done else None


def _clean(name: str) -> str:
    """A parameter's name as a state dict names it (no compile or checkpoint wrapper parts)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _frozen(model: torch.nn.Module) -> set[str]:
    """State-dict names of the parameters that get no gradient (a tied weight under each of
    its names)."""
    return {_clean(n) for n, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


def _trainable_state(model: torch.nn.Module, model_sd: dict) -> dict:
    """`model_sd` without the parameters that get no gradient (buffers stay)."""
    frozen = _frozen(model)
    return {k: v for k, v in model_sd.items() if k not in frozen}


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards `model` (its parameters are DTensors)."""
    return any(hasattr(p, "to_local") for p in model.parameters())


def _digest(rows) -> str:
    """A short digest of a set of text rows (their order does not matter)."""
    import hashlib

    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()[:16]


def frozen_fingerprint(model: torch.nn.Module) -> str:
    """A short digest of which parameters are frozen: a checkpoint holds only the others, so a
    resume must freeze the same ones."""
    return _digest(_frozen(model))


def frozen_dtypes_fingerprint(model: torch.nn.Module) -> str:
    """A short digest of the dtypes the frozen parameters are held in (`model.frozen_dtype`):
    a resume rebuilds the frozen base, so it must hold it as the run did."""
    return _digest({f"{_clean(n)}:{p.dtype}" for n, p in model.named_parameters(remove_duplicate=False)
                    if not p.requires_grad})


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    info: Topology,
    *,
    keep: int = 2,
    run_id: str | None = None,
) -> Path:
    """Save atomically; keep the newest `keep` checkpoints of run `run_id` (others are never
    touched). Collective: every rank calls it."""
    root = Path(output_dir) / "checkpoints"
    final = _step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = _trainable_state(model, model_sd)
    need = all_reduce([float(_tensor_bytes(model_sd) + _tensor_bytes(optim_sd))], info)[0]
    free = float(shutil.disk_usage(tmp).free)
    rotated = 0
    if all_reduce([float(need * HEADROOM > free)], info, "max")[0] and keep > 1:
        # rotate first: the checkpoints the rotation after this save would delete, never the
        # resume point (with keep=1 that is the only one, kept until the new one is written)
        rotated = len(_rotate(root, run_id, keep - 1)) if info.is_main else 0
        barrier(info)
        free = float(shutil.disk_usage(tmp).free)
    if all_reduce([float(need * HEADROOM > free)], info, "max")[0]:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        first = (f" after deleting {rotated} older checkpoint(s) of this run" if rotated else "")
        raise CheckpointSaveError(
            f"disk full: saving step {step} to {root} needs about {need / 1e9:.2f} GB but "
            f"{free / 1e9:.2f} GB is free{first}: free space there or set train.output_dir to a "
            f"larger disk{_resume_point(output_dir)} (the latest checkpoint is deleted only "
            "after the next one is written, so the disk holds two at a save)"
        )
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save({**trainer_state, "rng": rng_state()}, tmp / f"trainer_rank{info.rank}.pt")
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP's wraps a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(
            f"writing step {step} to {tmp} failed ({_reason(e)}); "
            f"{shutil.disk_usage(root).free / 1e9:.2f} GB is free there and the checkpoint needs "
            f"about {need / 1e9:.2f} GB (a full disk shows as this)"
            f"{_resume_point(output_dir)}. The partial folder "
            "is removed"
        ) from None
    barrier(info)
    if info.is_main:
        (tmp / MARKER).write_text(json.dumps({"step": step, "world_size": info.world_size,
                                               "run_id": run_id,
                                               "frozen": frozen_fingerprint(model),
                                               "frozen_dtypes": frozen_dtypes_fingerprint(model),
                                               "device": info.device.type,
                                               "sharded": _is_sharded(model)}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _rotate(root, run_id, keep)
    barrier(info)
    return final


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: Topology
) -> dict[str, Any]:
    """Restore model and optimizer in place; return this rank's trainer state (RNG restored)."""
    path = Path(path)
    marker_file = path / MARKER
    if not marker_file.is_file():
        raise ValueError(f"{path} is not a complete vlpack checkpoint (no {MARKER} marker)")
    saved_world = json.loads(marker_file.read_text())["world_size"]
    if saved_world != info.world_size:
        raise ValueError(
            f"{path} was saved by {saved_world} ranks but this run has {info.world_size}; resume "
            "with the same number of processes, or start anew in another train.output_dir (or in "
            "this one with train.resume=none train.overwrite=true, which deletes its checkpoints)"
        )
    saved = json.loads(marker_file.read_text())
    for key, now, differs in (
        ("frozen", frozen_fingerprint(model),
         "froze other parameters (model.freeze_*, model.lora or model.name differ): a checkpoint "
         "holds only the parameters that train, so this run would lose trained weights or miss "
         "some"),
        ("frozen_dtypes", frozen_dtypes_fingerprint(model),
         "held its frozen weights in other dtypes (model.frozen_dtype or model.dtype differ): "
         "resuming would train the adapters against another base than the one they were "
         "trained against"),
    ):
        if saved.get(key) not in (None, now):
            raise ValueError(f"{path} was saved by a run that {differs}. Resume with the run's "
                             "own settings (its config.yaml), or start anew in another "
                             "train.output_dir")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": _trainable_state(model, model_sd), "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    trainer = load_trainer_state(path / f"trainer_rank{info.rank}.pt")
    set_rng_state(trainer.pop("rng"))
    return trainer


def load_trainer_state(file: Path) -> dict[str, Any]:
    """A rank's trainer state, read with `weights_only=True`: tensors, containers, numbers and
    plain numpy arrays only (an Energon loader's state is bytes its loader reads with its own
    restricted unpickler), so the trainer state cannot make a resume run code."""
    state, refused = load_weights_only(file)
    if refused is not None:
        what = f"it names {refused}" if refused else "it cannot be read as one"
        raise ValueError(f"{file} holds more than a vlpack trainer state (tensors, numbers, "
                         f"containers): {what}, and vlpack does not run what a checkpoint's "
                         "pickle asks for. Resume from a checkpoint vlpack wrote")
    return state
