"""srun's task variables become torchrun's (train/distributed/slurm.py): literal environments, by hand."""

from __future__ import annotations

import os

import pytest

from vlpack.train.distributed.slurm import expand_tasks_per_node, first_host, torchrun_env

# what srun gives task 5 of `srun --nodes 2 --ntasks-per-node 4` on gpu07 and gpu08
SRUN_TASK_5 = {
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "4242",
}  # fmt: skip


def test_srun_task_becomes_torchrun_rank():
    assert torchrun_env(SRUN_TASK_5) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 4242),
    }  # fmt: skip


def test_uneven_nodes_and_step_values_win():
    # a 3-task step inside a job of 8 tasks: the step's own counts and hosts are the ones
    env = {**SRUN_TASK_5, "SLURM_STEP_NUM_TASKS": "3", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "gpu[08,11]"}
    out = torchrun_env(env)
    assert (out["RANK"], out["WORLD_SIZE"], out["LOCAL_WORLD_SIZE"], out["MASTER_ADDR"]) == \
        ("2", "3", "1", "gpu08")


def test_torchrun_and_user_settings_win():
    assert torchrun_env({**SRUN_TASK_5, "RANK": "0", "WORLD_SIZE": "2"}) == {}
    out = torchrun_env({**SRUN_TASK_5, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert "MASTER_ADDR" not in out and "MASTER_PORT" not in out and out["RANK"] == "5"


def test_not_under_srun():
    assert torchrun_env({}) == {}
    assert torchrun_env({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8"}) == {}  # salloc shell


def test_port_without_job_id():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "n1"}
    assert torchrun_env(env) == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                 "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("nodelist, host", [
    ("node3", "node3"), ("a1,b2", "a1"), ("gpu[007-009,012],login1", "gpu007"),
    ("gpu[12,3-4]", "gpu12"), ("rack1-n[5-6]", "rack1-n5"), ("[01-02]", "01"),
])  # fmt: skip
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_tasks_per_node():
    assert expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="tasks per node"):
        expand_tasks_per_node("4x2")


def test_bad_environment_is_named():
    with pytest.raises(ValueError, match="SLURM_NTASKS"):
        torchrun_env({"SLURM_PROCID": "0"})
    with pytest.raises(ValueError, match="outside the 4 tasks"):
        torchrun_env({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n1"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        torchrun_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_init_distributed_reads_srun(monkeypatch):
    """init_distributed joins as the rank srun names (a 1-task step: no peers to wait for)."""
    from vlpack.train.distributed.parallel import init_distributed

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so the values init_distributed sets are undone
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_NODELIST", "localhost")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    topo = init_distributed()
    assert (topo.rank, topo.world_size, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == \
        (0, 1, "localhost", "20007")


def test_check_cp_counts_srun_tasks(monkeypatch, capsys):
    """`vlpack check --cp 2` under srun checks srun's task count (3 tasks: refused by name)."""
    from vlpack.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_NODELIST": "n1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["check", "--model", "tiny-qwen3_vl", "--cp", "2"]) != 0
    assert "found WORLD_SIZE=3" in capsys.readouterr().err
