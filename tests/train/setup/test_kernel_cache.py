"""train.kernel_cache: where a GPU run keeps Triton's and Inductor's caches; train.tuned_kernels:
the fla kernel configurations vlpack measured on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlpack.train.setup.kernel_cache import (
    FLA_CONFIGS,
    FLA_DIR,
    FLA_MODE,
    INDUCTOR,
    TRITON,
    gpu_folder,
    keep_kernel_cache,
    use_tuned_kernels,
)


def test_run_keeps_both_caches_in_the_output_folder(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    chosen = keep_kernel_cache("run", tmp_path / "out", environ=env)
    assert env == chosen == {TRITON: str(tmp_path / "out" / "kernel_cache" / "triton"),
                             INDUCTOR: str(tmp_path / "out" / "kernel_cache" / "inductor")}
    assert Path(env[TRITON]).is_dir() and Path(env[INDUCTOR]).is_dir()


def test_a_folder_setting_is_shared_and_a_users_variable_wins(tmp_path: Path) -> None:
    env = {TRITON: "/mine/triton"}
    keep_kernel_cache(str(tmp_path / "shared"), tmp_path / "out", environ=env)
    assert env == {TRITON: "/mine/triton", INDUCTOR: str(tmp_path / "shared" / "inductor")}
    assert not (tmp_path / "out").exists()


def test_default_leaves_the_environment_alone(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert keep_kernel_cache("default", tmp_path, environ=env) == {} and env == {}


@pytest.mark.parametrize("setting", ["run", "default"])
def test_the_config_accepts_the_setting(setting: str) -> None:
    from vlpack.config import load_config

    assert load_config("tiny", [f"train.kernel_cache={setting}"]).train.kernel_cache == setting


# train.tuned_kernels: fla's kernel configurations measured on a GPU (FLA_CONFIG_DIR)


def test_a_measured_gpu_gets_its_folder_in_strict_mode() -> None:
    env: dict[str, str] = {}
    folder = use_tuned_kernels("NVIDIA H200", environ=env, modules={})
    assert folder == FLA_CONFIGS / "NVIDIA_H200"
    assert env == {FLA_MODE: "strict", FLA_DIR: str(folder)}


def test_other_gpus_a_users_setting_and_an_imported_fla_leave_fla_alone() -> None:
    for name, env, modules in [("NVIDIA GeForce RTX 4090", {}, {}),
                               ("NVIDIA H200", {FLA_MODE: "fuzzy"}, {}),
                               ("NVIDIA H200", {FLA_DIR: "/mine"}, {}),
                               ("NVIDIA H200", {}, {"fla.ops.utils.cache": object()})]:
        before = dict(env)
        assert use_tuned_kernels(name, environ=env, modules=modules) is None
        assert env == before


def test_gpu_folders_are_named_as_fla_names_them() -> None:
    assert gpu_folder("NVIDIA H200") == "NVIDIA_H200"
    assert gpu_folder("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert gpu_folder("--") == "unknown_gpu"


def test_the_kept_configurations_are_files_fla_reads() -> None:
    """Every file is `<kernel>.json` with fla's fields; each entry is filed under the md5 of its
    key's compact sorted JSON (worked by hand for one key below) and names a whole config."""
    import hashlib
    import json

    files = sorted((FLA_CONFIGS / "NVIDIA_H200").glob("*.json"))
    assert len(files) >= 10
    for f in files:
        data = json.loads(f.read_text())
        assert data["kernel_name"] == f.stem and data["triton_version"]
        for h, entry in data["autotune_entries"].items():
            text = json.dumps(entry["autotune_key"], separators=(",", ":"), sort_keys=True)
            assert h == hashlib.md5(text.encode()).hexdigest()
            assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= set(entry["config"])
    conv = json.loads((FLA_CONFIGS / "NVIDIA_H200" / "causal_conv1d_fwd_kernel.json").read_text())
    key = '[8192,4,"torch.bfloat16","torch.bfloat16","torch.float32","torch.int64","torch.int64"]'
    assert hashlib.md5(key.encode()).hexdigest() in conv["autotune_entries"]


def test_the_tool_keeps_tritons_fastest_configuration(tmp_path: Path) -> None:
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parents[3] / "tools"))
    try:
        import fla_configs
    finally:
        sys.path.pop(0)
    slow = {"kwargs": {"BT": 16}, "num_warps": 4, "num_stages": 2, "num_ctas": 1}
    fast = {"kwargs": {"BT": 64}, "num_warps": 8, "num_stages": 3, "num_ctas": 1}
    tie = {"kwargs": {"BT": 32}, "num_warps": 2, "num_stages": 3, "num_ctas": 1}
    d = tmp_path / "triton" / "HASHDIR"
    d.mkdir(parents=True)
    (d / "k_kernel.autotune.json").write_text(json.dumps({
        "key": [32, True, "torch.bfloat16"],
        "configs_timings": [[slow, [0.9, 0.8, 1.0]], [fast, [0.5, 0.6, 0.7]],
                            [tie, [0.5, 0.7, 0.7]]]}))
    assert fla_configs.main([str(tmp_path / "triton"), str(tmp_path / "out"),
                             "--triton-version", "3.6.0"]) == 0
    out = json.loads((tmp_path / "out" / "k_kernel.json").read_text())
    (entry,) = out["autotune_entries"].values()
    assert entry == {"autotune_key": [32, True, "torch.bfloat16"], "config": fast}
    assert out["kernel_name"] == "k_kernel" and out["triton_version"] == "3.6.0"


def test_fla_is_pointed_at_its_configurations_before_the_model_is_imported(monkeypatch) -> None:
    """fla reads FLA_CACHE_MODE when it is imported, and the memory plan's meta model imports
    it (through transformers' Qwen3.5 module): build_stack must set it before planning."""
    import torch

    from vlpack.config import load_config
    from vlpack.train.distributed.parallel import Topology
    from vlpack.train.setup import stack

    calls: list = []

    class PlannedError(Exception):
        pass

    def plan(*a, **k):
        calls.append("plan")
        raise PlannedError

    monkeypatch.setattr(stack, "keep_kernel_cache", lambda *a, **k: calls.append("cache"))
    monkeypatch.setattr(stack, "use_tuned_kernels", lambda name: calls.append(name))
    monkeypatch.setattr(stack, "plan_memory", plan)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    topo = Topology(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    with pytest.raises(PlannedError):
        stack.build_stack(load_config("qwen3.5-35b-a3b-lora"), topo)
    assert calls == ["cache", "NVIDIA H200", "plan"]
