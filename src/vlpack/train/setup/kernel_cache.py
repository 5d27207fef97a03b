"""Where a GPU run keeps its compiled kernels and Triton's autotuning results.

fla's Gated-DeltaNet kernels autotune on first use: on a fresh H200 the Qwen3.5-35B-A3B recipe's
first step waits minutes for it (docs/benchmarks.md). Triton keeps compiled kernels and, for
fla's kernels, the autotuning winners (`FLA_CACHE_RESULTS`, on by default) in its cache folder;
`torch.compile` keeps its kernels in Inductor's. Both default to the machine's home or /tmp, which a
fresh machine (a cloud node, a SLURM allocation) lacks. `train.kernel_cache=run` points both into
the run's output folder, so a resume or a later run that names the same folder starts warm.

A run on a fresh machine with an empty cache need not autotune either: fla reads kernel
configurations from a folder of JSON files (`FLA_CONFIG_DIR`, `FLA_CACHE_MODE`, fla's
`ops/utils/cache.py`). `fla_configs/<GPU>/` holds the winners vlpack measured on that GPU
(its README names the model, the versions and the command; tools/fla_configs.py writes them).
`train.tuned_kernels` points fla at them in strict mode: a kernel whose autotuning key matches
an entry exactly (the same head counts, head dims, dtypes and flags; for fla's l2norm kernels
also the row's tokens × heads in buckets of 65,536) starts from that configuration and compiles
it alone; any other key autotunes as before.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

log = logging.getLogger("vlpack.train")

TRITON = "TRITON_CACHE_DIR"
INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"
FLA_MODE = "FLA_CACHE_MODE"
FLA_DIR = "FLA_CONFIG_DIR"
FLA_CONFIGS = Path(__file__).parent / "fla_configs"
"""One folder of fla kernel configurations per GPU, named as fla names it (`gpu_folder`)."""


def kernel_cache_dir(setting: str, output_dir: Path) -> Path | None:
    """The folder `train.kernel_cache` names: `run` → OUTPUT_DIR/kernel_cache, `default` → None
    (the libraries' own defaults), anything else → that folder."""
    if setting == "default":
        return None
    return output_dir / "kernel_cache" if setting == "run" else Path(setting)


def keep_kernel_cache(setting: str, output_dir: Path, *, announce: bool = False,
                      environ: dict[str, str] | None = None) -> dict[str, str]:
    """Point Triton's and Inductor's caches at `train.kernel_cache` for this process (before
    any kernel compiles); a cache folder set in the environment by the user is kept. Returns the
    variables set."""
    env = os.environ if environ is None else environ
    root = kernel_cache_dir(setting, output_dir)
    if root is None:
        return {}
    chosen = {}
    for var, sub in ((TRITON, "triton"), (INDUCTOR, "inductor")):
        if var in env:
            if announce:
                log.info("%s=%s is set: train.kernel_cache=%s leaves it", var, env[var], setting)
            continue
        path = (root / sub).resolve()
        path.mkdir(parents=True, exist_ok=True)
        env[var] = chosen[var] = str(path)
    if announce and chosen:
        log.info("kernel cache (Triton, Inductor): %s", root)
    return chosen


def gpu_folder(device_name: str) -> str:
    """A GPU's folder name as fla spells it: `NVIDIA H200` → `NVIDIA_H200`."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def keeps_configurations(device_name: str) -> bool:
    """Whether vlpack keeps fla kernel configurations for `device_name`'s GPU."""
    return (FLA_CONFIGS / gpu_folder(device_name)).is_dir()


def use_tuned_kernels(device_name: str, *, environ: dict[str, str] | None = None,
                      modules=None) -> Path | None:
    """Point fla at the kernel configurations vlpack measured on `device_name`'s GPU
    (FLA_CACHE_MODE=strict, FLA_CONFIG_DIR) for this process. Returns the folder, or None when
    none is kept for this GPU, the user set either variable (theirs wins), or fla is imported
    already (it reads both when it is imported)."""
    env = os.environ if environ is None else environ
    folder = FLA_CONFIGS / gpu_folder(device_name)
    if not keeps_configurations(device_name):
        return None
    if FLA_MODE in env or FLA_DIR in env:
        log.info("%s/%s set in the environment: train.tuned_kernels leaves them", FLA_MODE, FLA_DIR)
        return None
    if "fla.ops.utils.cache" in (sys.modules if modules is None else modules):
        log.info("fla was imported before the model was built: its kernels autotune (set "
                 "%s=strict %s=%s before starting to use vlpack's configurations)", FLA_MODE,
                 FLA_DIR, folder)
        return None
    env[FLA_MODE], env[FLA_DIR] = "strict", str(folder)
    log.info("fla kernel configurations for %s: %s (other shapes autotune)", device_name, folder)
    return folder
