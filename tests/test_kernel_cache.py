"""train.kernel_cache: where a GPU run keeps Triton's and Inductor's caches."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlpack.train.kernel_cache import INDUCTOR, TRITON, keep_kernel_cache


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
