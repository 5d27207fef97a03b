"""Launching under SLURM's `srun` without torchrun: SLURM's task variables as torchrun's.

`srun` starts one task per GPU and tells each its place: `SLURM_PROCID` (global rank),
`SLURM_STEP_NUM_TASKS` / `SLURM_NTASKS` (world size), `SLURM_LOCALID` (rank on its node),
`SLURM_NODEID` and `SLURM_STEP_TASKS_PER_NODE` (tasks per node, compressed: `4(x2),3`), and
the step's hosts in `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST` (compressed: `gpu[01-04]`).
`torch.distributed`'s `env://` rendezvous reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
and vlpack reads LOCAL_RANK and LOCAL_WORLD_SIZE: `torchrun_env` derives them from SLURM's,
MASTER_ADDR being the first host of the step. Variables already set (by torchrun, or by the
user) win; without `SLURM_PROCID` nothing is derived.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

DEFAULT_PORT = 29500
"""MASTER_PORT without a SLURM job id (torchrun's default)."""


def torchrun_env(env: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) that `env` lacks, derived from SLURM's task variables; {} when `env` already
    has RANK or WORLD_SIZE (torchrun launched it) or is not an srun task.

    MASTER_PORT defaults to 20000 + SLURM_JOB_ID % 20000, so two jobs sharing a node do not
    collide (29500 without a job id).

    >>> torchrun_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
    ...               "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
    ...               "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123"})["MASTER_ADDR"]
    'gpu07'
    """
    if "RANK" in env or "WORLD_SIZE" in env or "SLURM_PROCID" not in env:
        return {}
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    rank = _int(env, "SLURM_PROCID")
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    if not 0 <= rank < world:
        raise ValueError(f"SLURM_PROCID={rank} is outside the {world} tasks SLURM reports: "
                         "launch one task per GPU with srun (not python inside the batch script)")
    out = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local)}
    per_node = next((env[k] for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                     if k in env), None)
    if per_node is not None:
        counts = expand_tasks_per_node(per_node)
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        if node < len(counts):
            out["LOCAL_WORLD_SIZE"] = str(counts[node])
    nodes = next((env[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                  if env.get(k)), None)
    if "MASTER_ADDR" not in env:
        if nodes is None:
            raise ValueError("srun gave no SLURM_JOB_NODELIST to find the first host: set "
                             "MASTER_ADDR to the host of rank 0")
        out["MASTER_ADDR"] = first_host(nodes)
    if "MASTER_PORT" not in env:
        job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", ""))
        out["MASTER_PORT"] = str(20000 + int(job) % 20000 if job.isdigit() else DEFAULT_PORT)
    return {k: v for k, v in out.items() if k not in env}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: `gpu[07-09,12],login1` → `gpu07` (zero padding
    kept), `a1,b2` → `a1`, `node3` → `node3`."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if m is None or not (m.group(1) or m.group(2)):
        raise ValueError(f"cannot read a host from SLURM's node list {nodelist!r}: set "
                         "MASTER_ADDR to the host of rank 0")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def expand_tasks_per_node(spec: str) -> list[int]:
    """Tasks on each node from SLURM's compressed form: `4(x2),3` → [4, 4, 3]."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"cannot read SLURM's tasks per node {spec!r} (expected a form "
                             "like 4(x2),3): set LOCAL_WORLD_SIZE")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _int(env: Mapping[str, str], *names: str) -> int:
    """The first of `names` set in `env`, as an int; a clear error when none is or it is not
    a number."""
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"{name}={env[name]!r} is not a number: launch with srun, "
                                 "which sets it") from None
    raise ValueError(f"SLURM_PROCID is set but {' / '.join(names)} is not: launch one task per "
                     "GPU with srun, or set RANK and WORLD_SIZE yourself")
