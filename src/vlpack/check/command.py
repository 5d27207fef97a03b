"""`vlpack check` assembled: its flags as the config's `model` and `train` sections, its model
built through the stack builder (train/setup/stack.py `build_check_model`: the trainer's build stage,
in float32), then check/run.py's comparison (`run_check`) and report.

The check sits above train/ because it builds through train/setup/stack.py: model code imports
nothing from train/ (whose parallelism imports torch.distributed), and nothing in model/ or
train/ imports the check.

`vlpack check --cp N` on k·N processes runs k data-parallel replicas of a context-parallel
group. Each replica checks its own row (the samples in another order, `data.load_samples`), so
a collective that runs over the wrong group (keys and values gathered over the world instead
of the context group) hands a rank rows of another replica's sample and fails the check; with
one replica the two groups coincide and such a bug goes unseen. The replicas' reports are
merged on every rank (`merge_replicas`): the check passes only if every replica passes.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist

from vlpack.check.data import refuse_init
from vlpack.check.run import (
    EXIT_COULD_NOT_RUN,
    EXIT_FAILED,
    EXIT_PASSED,
    format_report,
    refuse_unsupported,
    run_check,
)
from vlpack.config import Config, ModelConfig, TrainConfig
from vlpack.data.media import DataFile
from vlpack.model.context import ContextGroup
from vlpack.train.setup.prepare import autocast_dtype
from vlpack.train.setup.stack import build_check_model

logger = logging.getLogger("vlpack.check")


def check_config(model_name: str, *, backend: str = "auto", dtype: str | None = None,
                 seed: int = 0, weights: str = "auto") -> Config:
    """The check's flags as a config: `model.name`, `model.backend`, `model.dtype` (None:
    `auto`), `model.init` from `weights`, the `--init` flag (`auto` is `pretrained`: a folder's
    weights) and `train.seed`.
    Nothing is frozen, adapted, checkpointed or compiled."""
    return Config(model=ModelConfig(name=model_name, backend=backend, dtype=dtype or "auto",
                                    init="random" if weights == "random" else "pretrained"),
                  train=TrainConfig(seed=seed))


def check(model_name: str, *, backend: str = "auto", dtype: str | None = None,
          samples: int = 4, seed: int = 0, data: DataFile | None = None,
          device: str | None = None, context: ContextGroup | None = None,
          weights: str = "auto", replica: int = 0) -> dict:
    """Build the model of `model_name` (a preset or HF folder) and run the check on it
    (`run.run_check`, which says what the arguments mean); returns the report dict.
    `dtype` None: bfloat16 on CUDA, else float32, as `model.dtype=auto` trains. `weights`
    (`--init`): "auto" (a folder's weights) or "random" (random weights of its config,
    `seed`). Raises `CheckUnsupportedError` (a ValueError) when it cannot run as asked."""
    if device is None and context is not None and context.size > 1 and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or ("bfloat16" if autocast_dtype(check_config(model_name), dev) else "float32")
    refuse_unsupported(backend, dtype, dev)
    refuse_init(model_name, weights)
    cfg = check_config(model_name, backend=backend, dtype=dtype, seed=seed, weights=weights)
    model, spec = build_check_model(cfg, dev)
    return run_check(model, spec, dtype=dtype, device=dev, backend=backend, samples=samples,
                     seed=seed, data=data, context=context, weights=weights, replica=replica)


def check_command(model_name: str, *, backend: str, dtype: str | None, samples: int, seed: int,
                  data: DataFile | None, weights: str = "auto", as_json: bool = False,
                  context: ContextGroup | None = None, replicas: int = 1) -> int:
    """`vlpack check`: run `check` and print its report (JSON with `as_json`); 0 passed, 1
    failed, 2 could not run. `context`: the context-parallel group of `--cp N` (made by the
    CLI); `replicas`: how many data-parallel replicas of it the world holds, each checking its
    own row (`merge_replicas`)."""
    replica = int(os.environ.get("RANK", "0")) // context.size if replicas > 1 else 0
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        r = check(model_name, backend=backend, dtype=dtype, samples=samples, seed=seed,
                  data=data, context=context, weights=weights, replica=replica)
    except Exception as e:  # any reason the check could not run is exit status 2, not 1
        if os.environ.get("VLPACK_TRACEBACK"):
            raise
        if context is not None and collective_error(e):
            # the model was built and a packed forward's collective broke: the contract
            # failed (e.g. a gather over the world where the context group was meant)
            print(f"vlpack check FAILED: a collective of the packed forward failed on rank "
                  f"{os.environ.get('RANK', '0')} under --cp {context.size} with "
                  f"{replicas} data-parallel replica(s): {str(e).splitlines()[0]} (a collective "
                  "over another process group than the context group's?)", file=sys.stderr)
            return EXIT_FAILED
        where = "" if isinstance(e, ValueError) else \
            f" ({type(e).__name__}; VLPACK_TRACEBACK=1 shows where)"
        print(f"vlpack check could not run: {e}{where}", file=sys.stderr)
        logger.debug("check failed to run", exc_info=True)
        return EXIT_COULD_NOT_RUN
    if replicas > 1:  # every rank gathers every replica's report
        reports: list[dict] = [{}] * dist.get_world_size()
        dist.all_gather_object(reports, r)
        r = merge_replicas(r, reports)
    if rank0:  # every rank has the same report under --cp
        print(json.dumps(r, default=float) if as_json else format_report(r))
        if context is not None and replicas == 1 and not as_json:
            print(f"note: with one replica the context group is every process, so a collective "
                  f"over the wrong group goes unseen: run {2 * context.size} processes (2 "
                  "data-parallel replicas) to check that too")
    return EXIT_PASSED if r["passed"] else EXIT_FAILED


def collective_error(e: BaseException) -> bool:
    """Whether `e` is a failed collective (torch.distributed's errors and the backends'
    messages), as opposed to a check that could not start."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("ProcessGroupGloo", "ProcessGroupNCCL", "NCCL error", "Gloo"))


def merge_replicas(report: dict, reports: list[dict]) -> dict:
    """`report` of this process merged with every process's `reports` (this one's included;
    `check_command` gathers them): `passed` only if all passed, each failure (and each of the
    bf16 items' `bf16_failures`) prefixed with its replica (once per replica), `replicas`
    listing each replica's samples, result and largest logit difference."""
    first = {}
    for r in reports:
        first.setdefault(r["replica"], r)

    def prefixed(key: str) -> list[str]:
        return [f"replica {k}: {f}" for k, r in sorted(first.items()) for f in r.get(key, [])]

    failures = prefixed("failures")
    replicas = [dict(replica=k, passed=r["passed"], sample_keys=r["sample_keys"],
                     max_logit_diff=r["max_logit_diff"]) for k, r in sorted(first.items())]
    return {**report, "failures": failures, "bf16_failures": prefixed("bf16_failures"),
            "passed": not failures, "replicas": replicas}
