"""What a user sees when a run cannot start or changes under a resume: an unwritable output
folder, a model too large for the machine, changed settings on resume."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from tests.helpers import CPU, small_cfg
from vlpack.train import memory
from vlpack.train.loop import Trainer


def test_unwritable_output_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"  # below a regular file: no folder can be made there
    with pytest.raises(ValueError, match=rf"train.output_dir={out} is not writable .*choose a"):
        Trainer(small_cfg(out), CPU)


def test_a_model_too_large_fails_before_it_is_built(tmp_path: Path, monkeypatch) -> None:
    """The 35B-A3B preset on a machine with a few GiB: refused in about a second, with the
    numbers, instead of running out of host memory while building random weights."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 * memory.GIB)
    with pytest.raises(ValueError, match=r"model.name=qwen3.5-35b-a3b has 35.1\d B parameters .*"
                                         r"would take about 5\d\d.\d GiB on each cpu device, but 8.0 GiB"):
        Trainer(small_cfg(tmp_path, "model.name=qwen3.5-35b-a3b"), CPU)


def test_resume_with_changed_settings_warns_and_keeps_the_old_config(tmp_path: Path,
                                                                      caplog, capfd) -> None:
    Trainer(small_cfg(tmp_path, "train.max_steps=1", "optim.lr=1e-4", "train.progress=true"),
            CPU).fit()
    err = capfd.readouterr().err  # with train.progress the work after the last step is named
    assert "vlpack: saving step 1…\n" in err and "vlpack: saved step 1 in " in err
    assert f"vlpack: plotting {tmp_path / 'loss.png'}" in err
    caplog.set_level(logging.WARNING, logger="vlpack.train.loop")
    Trainer(small_cfg(tmp_path, "train.max_steps=2", "optim.lr=2e-4", "data.seq_len=1024"),
            CPU).fit()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "resuming at step 1 with changed settings" in text, text
    assert "data.seq_len 512 → 1024" in text and "optim.lr 0.0001 → 0.0002" in text
    assert "which samples come next" in text and "max_steps" not in text
    old = yaml.safe_load((tmp_path / "config.step00000001.yaml").read_text())
    new = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (old["optim"]["lr"], new["optim"]["lr"]) == (1e-4, 2e-4)

