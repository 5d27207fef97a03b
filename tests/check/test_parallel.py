"""`vlpack check --cp N` on k·N processes (check/command.py's replicas): data-parallel replicas of a
context-parallel group."""

from __future__ import annotations

import json
from pathlib import Path

from vlpack.cli import main


def _check_rank(rank: int, port: int, out: str, world: int) -> None:
    """One process of `vlpack check --cp 2` over `world` gloo ranks (torchrun's environment),
    run three times: as it is, then with the text attention's key/value gather planted to run
    over the world instead of the context group (into a buffer for the world, then into one
    for the group). Each rank writes the exit codes and printed reports to `out`.RANK."""
    import contextlib
    import io
    import os

    import torch
    import torch.distributed as dist

    from vlpack.model import context

    def over_world(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        x = x.contiguous()
        full = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(full, x)  # no group: the world
        return full[: size * x.shape[0]]

    def over_world_into_a_group_buffer(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        x = x.contiguous()
        full = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(full, x)  # the world into the group's buffer: gloo refuses
        return full

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    results = []
    for plant in (None, over_world, over_world_into_a_group_buffer):
        if plant is not None:
            context._GatherRows.forward = staticmethod(plant)
        printed, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            rc = main(["check", "--model", "tiny-qwen3_vl", "--cp", "2", "--samples", "2",
                       "--json"])
        results.append(dict(rc=rc, report=printed.getvalue().strip(), errors=errors.getvalue()))
    Path(f"{out}.{rank}").write_text(json.dumps(results))


def test_check_cp_with_data_parallel_replicas(tmp_path):
    """`vlpack check --cp 2` on 4 processes: 2 data-parallel replicas × 2 context-parallel
    ranks, each replica its own row. It passes; with the keys and values gathered over the
    world instead of the context group, replica 1 reads replica 0's rows and the check fails
    (exit 1 on every rank), naming the replica; gathered over the world into the context
    group's buffer, the collective itself fails, and that is a failure too (exit 1)."""
    from tests.helpers import run_ranks

    out = tmp_path / "ranks"
    assert run_ranks(_check_rank, str(out), 4, world=4, timeout=600) == [0] * 4
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    (clean, planted) = [json.loads(x["report"].splitlines()[-1]) for x in ranks[0][:2]]
    for r in (clean, planted):
        assert [x["replica"] for x in r["replicas"]] == [0, 1] and r["cp"] == 2
        assert r["replicas"][0]["sample_keys"] == r["replicas"][1]["sample_keys"][::-1]
    assert [x[0]["rc"] for x in ranks] == [0] * 4 and clean["passed"], clean["failures"]
    assert [x[1]["rc"] for x in ranks] == [1] * 4 and not planted["passed"]
    assert planted["replicas"][0]["passed"] and not planted["replicas"][1]["passed"]
    assert all(f.startswith("replica 1: ") for f in planted["failures"]), planted["failures"]
    assert any("dlogits" in f for f in planted["failures"]), planted["failures"]
    # gathered over the world into a buffer sized for the context group: gloo refuses the
    # collective on every rank, a failure of the contract (exit 1), not "could not run" (2)
    assert [x[2]["rc"] for x in ranks] == [1] * 4, [x[2]["errors"][-300:] for x in ranks]
    assert all("FAILED: a collective of the packed forward failed" in x[2]["errors"]
               for x in ranks)
