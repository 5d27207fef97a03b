"""What a resumed run reads before the model is built, and what it warns about as it resumes.

Before the build: the checkpoint train.resume names, the run id it carries and the bins
(data.seq_len, train.micro_batches) of the run it continues. On resume: every setting that
differs from the run's config.yaml (the old file kept), and every data file whose content
changed since the checkpoint was saved.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from vlpack.config import Config
from vlpack.train.run import checkpoint as ckpt

log = logging.getLogger("vlpack.train")


UNTRACKED = ("train.resume", "train.resume_fallback", "train.overwrite", "train.progress", "train.max_steps",
             "train.stop_after", "train.output_dir", "train.keep_checkpoints", "train.export_hf",
             "train.export_dtype", "train.kernel_cache", "train.tuned_kernels",
             "train.memory_check", "train.report_to_errors", "train.eval_generate_every",
             "train.eval_generate_samples", "train.eval_generate_max_new_tokens",
             "train.profile_steps", "train.profile_from")
"""Settings a resumed run may change without a warning: none changes what is trained."""
ORDER_NEUTRAL = ("data.num_workers", "data.pad_to_seq_len", "data.mrope_after_video",
                 "data.max_consecutive_bad", "data.max_bad_fraction")
"""Data settings that change no sample's place in the stream (the resume warning lists them
without saying which samples come next changes)."""


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def warn_changed_data(saved: dict[str, str], now: dict[str, str], path: Path) -> None:
    """On resume: warn about each data file whose content differs from what the checkpoint
    `path` recorded (the stream continues by position, over the edited rows)."""
    for file in sorted(saved.keys() & now.keys()):
        if saved[file] != now[file]:
            log.warning("the data file %s changed since the checkpoint %s was saved: the stream "
                        "continues by position, so the samples after it differ from those the "
                        "run would have read; resume with the file as it was, or start anew "
                        "(train.resume=none)", file, path)


def keep_changed_config(cfg: Config, path: Path, step: int) -> None:
    """On resume: warn about every setting that differs from the run's config.yaml and keep the
    old file as config.stepNNNNNNNN.yaml (the settings up to that step)."""
    import yaml

    if not path.is_file():
        return
    old, new = _flat(yaml.safe_load(path.read_text()) or {}), _flat(cfg.to_dict())
    changed = [k for k in sorted(old.keys() | new.keys())
               if old.get(k) != new.get(k) and k not in UNTRACKED]
    if not changed:
        return
    kept = path.with_name(f"config.step{step:08d}.yaml")
    shutil.copyfile(path, kept)
    diff = ", ".join(f"{k} {old.get(k)!r} → {new.get(k)!r}" for k in changed)
    data = (" The data stream continues by position, so the changed data settings change which "
            "samples come next." if any(k.startswith("data.") and k not in ORDER_NEUTRAL
                                        for k in changed) else "")
    log.warning("resuming at step %d with changed settings: %s.%s The settings up to step %d "
                "are kept in %s", step, diff, data, step, kept)


def _resume_point(cfg: Config) -> Path | None:
    """The checkpoint train.resume names, before anything loads: the newest complete one of
    output_dir for `auto`, the folder given, None for `none` or a fresh folder."""
    r = cfg.train.resume
    if r == "none":
        return None
    return ckpt.latest_checkpoint(cfg.train.output_dir) if r == "auto" else Path(r)


def run_id(cfg: Config) -> str | None:
    """The run's id, read before the model is built: that of the checkpoint train.resume
    continues (None where it records none; its files are verified when it loads), else a new one."""
    path = _resume_point(cfg)
    if path is None:
        return uuid.uuid4().hex[:12]
    try:
        return ckpt.marker(path).get("run_id")
    except (OSError, ValueError):  # no readable marker: maybe_resume names the problem
        return None


def resumed_bins(cfg: Config) -> tuple[int, int] | None:
    """(data.seq_len, train.micro_batches) of the run train.resume continues, from the
    config.yaml of its folder; None for a fresh run or where that file is missing."""
    path = _resume_point(cfg)
    saved = None if path is None else path.parent.parent / "config.yaml"
    if saved is None or not saved.is_file():
        return None
    import yaml

    old = yaml.safe_load(saved.read_text()) or {}
    try:
        return int(old["data"]["seq_len"]), int(old["train"]["micro_batches"])
    except (KeyError, TypeError, ValueError):
        return None
