"""Where a GPU run keeps its compiled kernels and Triton's autotuning results.

fla's Gated-DeltaNet kernels autotune on first use: on a fresh H200 the Qwen3.5-35B-A3B recipe's
first step waits minutes for it (docs/benchmarks.md). Triton keeps compiled kernels and, for
fla's kernels, the autotuning winners (`FLA_CACHE_RESULTS`, on by default) in its cache folder;
`torch.compile` keeps its kernels in Inductor's. Both default to the machine's home or /tmp, which a
fresh machine (a cloud node, a SLURM allocation) lacks. `train.kernel_cache=run` points both into
the run's output folder, so a resume or a later run that names the same folder starts warm.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("vlpack.train")

TRITON = "TRITON_CACHE_DIR"
INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"


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
