"""Checkpoints: sharded torch.distributed.checkpoint saves, written atomically.

Layout: `output_dir/checkpoints/step_00000020/` holds the DCP shards of model + optimizer, one
`trainer_rank{r}.pt` per rank (scheduler, RNG, data-loader position, counters) and a COMPLETE
marker (step, world size, run id, and the size and sha256 of every other file in the folder). A
save goes to `step_…​.tmp/` and is renamed only after every rank finished, so a kill during a save
leaves the previous checkpoint as the latest usable one.

Integrity: right after writing, each rank hashes the files it wrote (its `__{r}_*.distcp` shards
and `trainer_rank{r}.pt`; rank 0 also `.metadata`), streamed in 8 MiB chunks; rank 0 gathers them
into the marker, written last. A resume checks every file's size and digest before loading
(`resume_point`; the ranks split the files) and refuses a damaged, truncated or missing one with
a `CheckpointIntegrityError` naming the file and the newest intact checkpoint beside it;
`train.resume_fallback=true` resumes from that one instead. Hashing reads what was just written,
mostly from the page cache, at about 0.7 GiB/s per rank (sha256 on one Xeon core, measured in
docs/training.md): a LoRA checkpoint (0.1 GiB) adds about 0.15 s to a save and to a resume, a
full fine-tune about 1.4 s per GiB each rank wrote. A checkpoint whose marker records no digests
resumes with a warning that it is not verified.
Rotation deletes only checkpoints of the same run id: a run never deletes another run's. It runs
after the new checkpoint is written, or before it when the disk is too full for it: then the
checkpoints rotation would delete anyway go first, never the latest (the resume point).

A checkpoint holds the parameters that train, not the frozen ones (a LoRA run's base is 65 GiB
for Qwen3.5-35B-A3B, its adapters 0.1): a resumed run builds the frozen weights again from the
same `model.name` and seed, as the run itself did.
"""

from __future__ import annotations

import hashlib
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
from vlpack.train.distributed.parallel import Topology, all_gather_object, all_reduce, barrier
from vlpack.train.setup.precision import input_embedding

MARKER = "COMPLETE"
HEADROOM = 1.1
"""A save starts only when the disk has this many times the checkpoint's size free."""
CHUNK = 8 << 20
"""Bytes read per update while hashing a checkpoint file."""

log = logging.getLogger(__name__)


class CheckpointSaveError(ValueError):
    """A checkpoint could not be written (disk full, write failed); nothing partial is left and
    the previous checkpoint stays the resume point. The message says how much space it needs."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint's file is missing, truncated or differs from the digest its marker records,
    or torch cannot load it. The message names the file and the newest intact checkpoint."""


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
    the digest of the frozen parameters' names, the device type the run trained on, whether
    FSDP2 sharded it (where the frozen base was drawn: vlpack.train.run.export rebuilds it) and
    `files`, each other file's name → {bytes, sha256} (absent in older checkpoints)."""
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
    a resume rebuilds the frozen base, so it must hold it as the run did. The input embedding
    (and a weight tied to it) is left out: held in bf16 (`precision.HeldEmbedding`) it gives the
    float32 table's values, so a run that held it in float32 resumes exactly either way."""
    emb = input_embedding(model)
    skip = {id(p) for p in emb.parameters()} if emb is not None else set()
    return _digest({f"{_clean(n)}:{p.dtype}" for n, p in model.named_parameters(remove_duplicate=False)
                    if not p.requires_grad and id(p) not in skip})


def file_digest(file: Path) -> str:
    """The sha256 of `file`, read in CHUNK-byte pieces (about 0.7 GiB/s on one core)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _record(files) -> dict[str, dict[str, Any]]:
    """name → {bytes, sha256} of each of `files`."""
    return {f.name: {"bytes": f.stat().st_size, "sha256": file_digest(f)} for f in files}


def _manifest(folder: Path, topo: Topology) -> dict[str, dict[str, Any]]:
    """Every file in a written checkpoint folder but the marker, with its size and sha256: each
    rank hashes the files it wrote (its DCP shards, its trainer state), rank 0 the rest
    (`.metadata`). Collective; the result is complete on rank 0 only."""
    own = [*folder.glob(f"__{topo.rank}_*.distcp"), folder / f"trainer_rank{topo.rank}.pt"]
    files: dict[str, dict[str, Any]] = {}
    for part in all_gather_object(_record(own), topo):
        files.update(part)
    if topo.is_main:
        files.update(_record([f for f in folder.iterdir()
                              if f.is_file() and f.name != MARKER and f.name not in files]))
    return dict(sorted(files.items()))


def _file_problem(folder: Path, name: str, want: dict[str, Any]) -> str | None:
    """What is wrong with one recorded file ('FILE: what'), or None."""
    f = folder / name
    if not f.is_file():
        return f"{f} is missing"
    if (size := f.stat().st_size) != want["bytes"]:
        return (f"{f} has {size} bytes where the checkpoint recorded {want['bytes']} (truncated "
                "or overwritten)")
    if file_digest(f) != want["sha256"]:
        return f"{f} has the recorded size but not the recorded sha256 (its bytes are damaged)"
    return None


def check_files(folder: Path, topo: Topology) -> str | None:
    """The first problem found in `folder`'s files against the sizes and digests its marker
    records, or None when all match or it records none (an older checkpoint, not verifiable).
    The ranks split the files; collective, every rank gets the same answer."""
    try:
        files = marker(folder).get("files")
    except (OSError, ValueError) as e:
        return f"{folder / MARKER} cannot be read ({_reason(e)})"
    if files is None:
        return None
    names = sorted(files)
    mine = [p for i, n in enumerate(names)
            if i % topo.world_size == topo.rank and (p := _file_problem(folder, n, files[n]))]
    found = sorted(p for part in all_gather_object(mine, topo) for p in part)
    if not found:
        return None
    more = f" (and {len(found) - 1} more file(s))" if len(found) > 1 else ""
    return found[0] + more


def _intact_before(folder: Path, topo: Topology) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint beside `folder` and older than it whose files match their
    digests (or record none), and the damaged ones passed on the way with their problems."""
    older = sorted((p for p in folder.parent.glob("step_*")
                    if p.is_dir() and (p / MARKER).is_file() and p.name < folder.name),
                   reverse=True)
    skipped = []
    for p in older:
        if (problem := check_files(p, topo)) is None:
            return p, skipped
        skipped.append((p, problem))
    return None, skipped


def _way_out(folder: Path, intact: Path | None, skipped: list[tuple[Path, str]]) -> str:
    """What the user can do about damaged `folder`: the intact checkpoint, or starting anew."""
    also = (" (" + "; ".join(f"{p.name} is damaged too: {why}" for p, why in skipped) + ")"
            if skipped else "")
    if intact is None:
        return (f"no intact checkpoint is left in {folder.parent}{also}: start anew with "
                "train.resume=none train.overwrite=true")
    return (f"the newest intact checkpoint is {intact}{also}: resume from it with "
            f"train.resume={intact}, or let train.resume=auto take it with "
            "train.resume_fallback=true")


def resume_point(path: str | Path, topo: Topology, *, fallback: bool = False) -> Path:
    """`path` when every file matches the size and sha256 its marker records (one that records
    none resumes with a warning that it is not verified). Otherwise, with `fallback`, the newest
    intact checkpoint beside it, logging which were skipped and why; without, a
    CheckpointIntegrityError naming the file, the problem and that checkpoint. Collective."""
    path = Path(path)
    problem = check_files(path, topo)
    if problem is None:
        if topo.is_main and "files" not in marker(path):
            log.warning("%s records no file digests (written by an older vlpack): resuming from "
                        "it without verifying its files", path)
        return path
    intact, skipped = _intact_before(path, topo)
    if fallback and intact is not None:
        if topo.is_main:
            for p, why in [(path, problem), *skipped]:
                log.warning("train.resume_fallback: skipping %s: %s", p, why)
            log.warning("train.resume_fallback: resuming from %s, the newest intact checkpoint",
                        intact)
        return intact
    raise CheckpointIntegrityError(f"{path} is damaged: {problem}; "
                                   f"{_way_out(path, intact, skipped)}")


def _load_failed(path: Path, why: str, topo: Topology) -> CheckpointIntegrityError:
    """The error for a checkpoint torch could not load, naming it and the intact one beside it.
    Collective (every rank raises it)."""
    intact, skipped = _intact_before(path, topo)
    return CheckpointIntegrityError(f"loading {path} failed ({why}): a file in it is damaged or "
                                    f"missing; {_way_out(path, intact, skipped)}")


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    topo: Topology,
    *,
    keep: int = 2,
    run_id: str | None = None,
) -> Path:
    """Save atomically; keep the newest `keep` checkpoints of run `run_id` (others are never
    touched). Collective: every rank calls it."""
    root = Path(output_dir) / "checkpoints"
    final = _step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if topo.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(topo)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = _trainable_state(model, model_sd)
    need = all_reduce([float(_tensor_bytes(model_sd) + _tensor_bytes(optim_sd))], topo)[0]
    free = float(shutil.disk_usage(tmp).free)
    rotated = 0
    if all_reduce([float(need * HEADROOM > free)], topo, "max")[0] and keep > 1:
        # rotate first: the checkpoints the rotation after this save would delete, never the
        # resume point (with keep=1 that is the only one, kept until the new one is written)
        rotated = len(_rotate(root, run_id, keep - 1)) if topo.is_main else 0
        barrier(topo)
        free = float(shutil.disk_usage(tmp).free)
    if all_reduce([float(need * HEADROOM > free)], topo, "max")[0]:
        if topo.is_main:
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
        torch.save({**trainer_state, "rng": rng_state()}, tmp / f"trainer_rank{topo.rank}.pt")
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP's wraps a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(
            f"writing step {step} to {tmp} failed ({_reason(e)}); "
            f"{shutil.disk_usage(root).free / 1e9:.2f} GB is free there and the checkpoint needs "
            f"about {need / 1e9:.2f} GB (a full disk shows as this)"
            f"{_resume_point(output_dir)}. The partial folder "
            "is removed"
        ) from None
    barrier(topo)
    files = _manifest(tmp, topo)
    if topo.is_main:
        (tmp / MARKER).write_text(json.dumps({"step": step, "world_size": topo.world_size,
                                               "run_id": run_id,
                                               "frozen": frozen_fingerprint(model),
                                               "frozen_dtypes": frozen_dtypes_fingerprint(model),
                                               "device": topo.device.type,
                                               "sharded": _is_sharded(model),
                                               "files": files}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _rotate(root, run_id, keep)
    barrier(topo)
    return final


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, topo: Topology,
    *, verify: bool = True,
) -> dict[str, Any]:
    """Restore model and optimizer in place; return this rank's trainer state (RNG restored).
    Checks the files' digests first (`resume_point`; `verify=False` when the caller did); an
    error torch raises while loading becomes a CheckpointIntegrityError naming `path`."""
    path = Path(path)
    marker_file = path / MARKER
    if not marker_file.is_file():
        raise ValueError(f"{path} is not a complete vlpack checkpoint (no {MARKER} marker)")
    saved_world = json.loads(marker_file.read_text())["world_size"]
    if saved_world != topo.world_size:
        raise ValueError(
            f"{path} was saved by {saved_world} ranks but this run has {topo.world_size}; resume "
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
    if verify:
        resume_point(path, topo)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": _trainable_state(model, model_sd), "optim": optim_sd}
    meta = path / ".metadata"  # DCP logs a traceback per attempt at an empty one: refuse first
    if not meta.is_file() or not meta.stat().st_size:
        raise _load_failed(path, f"{meta} is {'empty' if meta.is_file() else 'missing'}", topo)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (CheckpointException, RuntimeError, OSError, EOFError, ValueError) as e:
        # DCP reports every rank's failure on every rank
        raise _load_failed(path, _reason(e), topo) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    file = path / f"trainer_rank{topo.rank}.pt"
    try:
        trainer, why = load_trainer_state(file), None
    except (RuntimeError, OSError, EOFError) as e:  # a truncated zip, a missing file
        trainer, why = None, f"{file}: {_reason(e)}"
    if failed := [w for w in all_gather_object(why, topo) if w]:
        raise _load_failed(path, failed[0], topo)
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
