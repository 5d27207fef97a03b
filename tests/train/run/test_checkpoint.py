"""A run owns its output folder: a fresh run never mixes with (or deletes) another run's
checkpoints, rotation keeps to its own run, and resume never runs past max_steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import CPU, losses, small_cfg
from vlpack.train.run import checkpoint as ckpt
from vlpack.train.trainer import Trainer


def _steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def test_fresh_run_over_an_older_run(tmp_path: Path) -> None:
    """The sequence that lost a run: an older 6-step run, then a new 4-step run with
    train.resume=none in the same folder, then a plain `vlpack train`."""
    out = tmp_path / "run"
    Trainer(small_cfg(out, "train.max_steps=6", "train.save_every=2"), CPU).fit()
    assert _steps(out) == ["step_00000004", "step_00000006"]
    fresh = ["train.max_steps=4", "train.save_every=2", "train.resume=none"]
    with pytest.raises(ValueError, match=r"another run .*train.overwrite=true"):
        Trainer(small_cfg(out, *fresh), CPU).fit()
    assert _steps(out) == ["step_00000004", "step_00000006"]  # refused before writing anything

    summary = Trainer(small_cfg(out, *fresh, "train.overwrite=true"), CPU).fit()
    assert _steps(out) == ["step_00000002", "step_00000004"]
    assert Path(summary["checkpoint"]).is_dir()
    assert len(losses(out)) == 4  # the old run's metrics went with its checkpoints

    again = Trainer(small_cfg(out, "train.max_steps=4", "train.save_every=2"), CPU)
    again.fit()
    assert again.step == 4 and _steps(out) == ["step_00000002", "step_00000004"]


def test_resume_past_max_steps_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(small_cfg(out, "train.max_steps=3"), CPU).fit()
    with pytest.raises(ValueError, match=r"step 3, past train.max_steps=2: raise train.max_steps"):
        Trainer(small_cfg(out, "train.max_steps=2"), CPU).fit()


def test_rotation_deletes_only_its_own_runs_checkpoints(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save_checkpoint(tmp_path, 10, model, opt, {}, CPU, keep=2, run_id="old")
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model, opt, {}, CPU, keep=2, run_id="new")
    assert _steps(tmp_path) == ["step_00000002", "step_00000003", "step_00000010"]
    markers = {p.name: json.loads((p / ckpt.MARKER).read_text())["run_id"]
               for p in (tmp_path / "checkpoints").glob("step_*")}
    assert markers == {"step_00000002": "new", "step_00000003": "new", "step_00000010": "old"}


def test_save_refused_up_front_when_the_disk_is_too_full(tmp_path: Path, monkeypatch) -> None:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = ckpt.save_checkpoint(tmp_path, 1, model, opt, {}, CPU, run_id="r")
    usage = ckpt.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(ckpt.CheckpointSaveError, match=r"disk full: saving step 2 .* needs about "
                       r"0\.00 GB but 0\.00 GB is free.*step_00000001 stays the resume point"):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {}, CPU, run_id="r")
    assert _steps(tmp_path) == ["step_00000001"] and ckpt.latest_checkpoint(tmp_path) == good


def test_failed_write_leaves_nothing_partial(tmp_path: Path, monkeypatch) -> None:
    """A write that fails half-way (as a full disk does) removes its partial folder."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = ckpt.save_checkpoint(tmp_path, 1, model, opt, {}, CPU, run_id="r")

    def half_written(state, checkpoint_id):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"x" * 4096)
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt.dcp, "save", half_written)
    with pytest.raises(ckpt.CheckpointSaveError, match=r"writing step 2 .* failed .*unexpected "
                       r"pos.* GB is free there .*a full disk shows as this"):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {}, CPU, run_id="r")
    assert _steps(tmp_path) == ["step_00000001"] and ckpt.latest_checkpoint(tmp_path) == good


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_disk_with_room_for_two_rotates_first(tmp_path: Path, monkeypatch) -> None:
    """A disk with room for two checkpoints (and the headroom of a third's estimate, not the
    third): the third save deletes the oldest first, never the resume point."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {}, CPU, run_id="r")
    size, need = _du(tmp_path / "checkpoints"), 64 * 65 * 4
    capacity = size * 3 // 2 + int(need * ckpt.HEADROOM)  # two fit, three do not
    usage = ckpt.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(
        free=capacity - _du(tmp_path / "checkpoints")))
    ckpt.save_checkpoint(tmp_path, 2, model, opt, {}, CPU, run_id="r")
    ckpt.save_checkpoint(tmp_path, 3, model, opt, {}, CPU, run_id="r")
    assert _steps(tmp_path) == ["step_00000002", "step_00000003"]
    # keep=1: the only checkpoint is the resume point, kept until the new one is written
    with pytest.raises(ckpt.CheckpointSaveError, match=r"step_00000003 stays the resume point "
                       r"\(the latest checkpoint is deleted only after the next one is written"):
        capacity = size + size // 2
        ckpt.save_checkpoint(tmp_path, 4, model, opt, {}, CPU, run_id="r", keep=1)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000003"


def test_write_failure_message_has_no_traceback(tmp_path: Path, monkeypatch) -> None:
    """DCP wraps each rank's failure with its traceback; the message keeps one line of it."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def disk_full(state, checkpoint_id):
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise CheckpointException("save failed", {0: _wrap_exception(e)}) from None

    monkeypatch.setattr(ckpt.dcp, "save", disk_full)
    with pytest.raises(ckpt.CheckpointSaveError) as info:
        ckpt.save_checkpoint(tmp_path, 1, model, opt, {}, CPU, run_id="r")
    msg = str(info.value)
    assert "(OSError: [Errno 28] No space left on device)" in msg
    assert "Traceback" not in msg and "File \"" not in msg and "\n" not in msg


def test_interrupted_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=2"), CPU)
    t.fit()
    good = ckpt.latest_checkpoint(tmp_path)
    broken = good.parent / "step_00000009.tmp"  # a save killed half-way
    broken.mkdir()
    (broken / "trainer_rank0.pt").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(tmp_path) == good


class _TouchOnLoad:
    """Unpickling it creates a file: what a hostile checkpoint could make a resume do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_trainer_state_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """The trainer state is read with weights_only: a pickle that calls a function on load is
    refused with the file and the name it asks for, and the function never runs. States as
    vlpack writes them load, numpy's RNG key as an array (older checkpoints) too."""
    from vlpack.train.run.checkpoint import load_trainer_state, rng_state

    ran = tmp_path / "ran"
    torch.save({"step": 3, "evil": _TouchOnLoad(ran)}, tmp_path / "hostile.pt")
    with pytest.raises(ValueError, match=r"hostile\.pt holds more than a vlpack trainer state .*: it names "):
        load_trainer_state(tmp_path / "hostile.pt")
    assert not ran.exists()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    for rng in (rng_state(), {"numpy": (kind, key, pos, has_gauss, cached)}):
        torch.save({"step": 3, "rng": rng}, tmp_path / "ok.pt")
        back = load_trainer_state(tmp_path / "ok.pt")
        assert back["step"] == 3 and list(back["rng"]["numpy"][1]) == key.tolist()


# Integrity: every file a checkpoint writes is recorded with its size and sha256 in the COMPLETE
# marker; a resume checks them first and names the damaged file and the intact checkpoint beside it.


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """A tiny run saved at steps 1 and 2 (copied by each test that damages it)."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    Trainer(small_cfg(out, "train.max_steps=2", "train.save_every=1"), CPU).fit()
    assert _steps(out) == ["step_00000001", "step_00000002"]
    return out


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run and its latest checkpoint's folder."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out, out / "checkpoints" / "step_00000002"


def _flip(f: Path) -> None:
    """XOR 4 KiB in the middle of `f`: same size, other bytes."""
    b = bytearray(f.read_bytes())
    mid = len(b) // 2 - 2048
    b[mid:mid + 4096] = bytes(x ^ 0xFF for x in b[mid:mid + 4096])
    f.write_bytes(bytes(b))


DAMAGE = {
    "flipped": ("__0_0.distcp", _flip, r"has the recorded size but not the recorded sha256"),
    "truncated": ("__0_0.distcp", lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
                  r"has \d+ bytes where the checkpoint recorded \d+ \(truncated"),
    "empty metadata": (".metadata", lambda f: f.write_bytes(b""),
                       r"has 0 bytes where the checkpoint recorded \d+"),
    "missing": ("trainer_rank0.pt", Path.unlink, r"is missing"),
}


def test_the_marker_records_every_file(two_steps: Path) -> None:
    for step in _steps(two_steps):
        folder = two_steps / "checkpoints" / step
        files = ckpt.marker(folder)["files"]
        assert set(files) == {p.name for p in folder.iterdir()} - {ckpt.MARKER}
        assert {".metadata", "__0_0.distcp", "trainer_rank0.pt"} <= set(files)
        assert all(files[n] == {"bytes": (folder / n).stat().st_size,
                                "sha256": ckpt.file_digest(folder / n)} for n in files)


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_intact_one(
        two_steps: Path, tmp_path: Path, damage: str) -> None:
    name, spoil, what = DAMAGE[damage]
    out, latest = _copy(two_steps, tmp_path)
    size = (latest / name).stat().st_size
    assert size > 8192 or name != "__0_0.distcp"  # the flip lies inside the file
    spoil(latest / name)
    intact = out / "checkpoints" / "step_00000001"
    with pytest.raises(ckpt.CheckpointIntegrityError) as info:
        Trainer(small_cfg(out, "train.max_steps=4"), CPU).fit()
    msg = str(info.value)
    assert re.search(re.escape(str(latest / name)) + " " + what, msg), msg
    assert f"the newest intact checkpoint is {intact}: resume from it with " in msg, msg
    assert "train.resume_fallback=true" in msg and "Traceback" not in msg
    assert _steps(out) == ["step_00000001", "step_00000002"]  # nothing trained or rotated


def test_fallback_resumes_from_the_intact_checkpoint(two_steps: Path, tmp_path: Path,
                                                     caplog) -> None:
    """train.resume_fallback=true skips the damaged latest checkpoint (the log says why) and
    continues from step 1 as if step 2 had never been saved: the losses of 4 straight steps."""
    out, latest = _copy(two_steps, tmp_path)
    _flip(latest / "__0_0.distcp")
    Trainer(small_cfg(tmp_path / "straight", "train.max_steps=4"), CPU).fit()
    with caplog.at_level("WARNING", logger="vlpack.train.run.checkpoint"):
        t = Trainer(small_cfg(out, "train.max_steps=4", "train.resume_fallback=true"), CPU)
        assert t.maybe_resume() == out / "checkpoints" / "step_00000001" and t.step == 1
    assert f"skipping {latest}: {latest / '__0_0.distcp'} has the recorded size but" in caplog.text
    assert "resuming from " + str(out / "checkpoints" / "step_00000001") in caplog.text
    Trainer(small_cfg(out, "train.max_steps=4", "train.resume_fallback=true"), CPU).fit()
    assert losses(out) == losses(tmp_path / "straight")


def test_no_intact_checkpoint_left_says_to_start_anew(two_steps: Path, tmp_path: Path) -> None:
    out, latest = _copy(two_steps, tmp_path)
    _flip(latest / "__0_0.distcp")
    (out / "checkpoints" / "step_00000001" / ".metadata").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointIntegrityError, match=r"no intact checkpoint is left in .*"
                       r"step_00000001 is damaged too: .*\.metadata has 0 bytes.*: start anew with "
                       r"train.resume=none train.overwrite=true"):
        Trainer(small_cfg(out, "train.max_steps=4", "train.resume_fallback=true"), CPU).fit()


def test_a_named_checkpoint_is_never_swapped(two_steps: Path, tmp_path: Path) -> None:
    """train.resume=FOLDER: the fallback applies to resume=auto only."""
    out, latest = _copy(two_steps, tmp_path)
    (latest / "trainer_rank0.pt").unlink()
    with pytest.raises(ckpt.CheckpointIntegrityError, match=r"trainer_rank0\.pt is missing"):
        Trainer(small_cfg(out, "train.max_steps=4", f"train.resume={latest}",
                          "train.resume_fallback=true"), CPU).fit()


def _unrecorded(folder: Path) -> None:
    """The marker as a checkpoint without digests has it."""
    m = ckpt.marker(folder)
    del m["files"]
    (folder / ckpt.MARKER).write_text(json.dumps(m))


def test_a_checkpoint_without_digests_resumes_with_a_warning(two_steps: Path, tmp_path: Path,
                                                             caplog) -> None:
    out, latest = _copy(two_steps, tmp_path)
    _unrecorded(latest)
    with caplog.at_level("WARNING", logger="vlpack.train.run.checkpoint"):
        t = Trainer(small_cfg(out, "train.max_steps=4"), CPU)
        assert t.maybe_resume() == latest and t.step == 2
    assert f"{latest} records no file digests" in caplog.text and "without verifying" in caplog.text


@pytest.mark.parametrize(("damage", "why"), [
    ("truncated", "RuntimeError: PytorchStreamReader failed"),  # DCP names no shard
    ("empty metadata", ".metadata is empty"),
    ("missing", "trainer_rank0.pt: FileNotFoundError"),
])
def test_torch_load_errors_name_the_checkpoint(two_steps: Path, tmp_path: Path, damage: str,
                                               why: str) -> None:
    """Without digests the damage shows only when torch loads: its error is re-raised naming
    the folder and the intact checkpoint beside it, without torch's traceback."""
    name, spoil, _ = DAMAGE[damage]
    out, latest = _copy(two_steps, tmp_path)
    _unrecorded(latest)
    spoil(latest / name)
    with pytest.raises(ckpt.CheckpointIntegrityError) as info:
        Trainer(small_cfg(out, "train.max_steps=4"), CPU).fit()
    msg = str(info.value)
    assert msg.startswith(f"loading {latest} failed (") and why in msg, msg
    assert f"the newest intact checkpoint is {out / 'checkpoints' / 'step_00000001'}" in msg
    assert "\n" not in msg


def test_the_digest_reads_every_chunk(tmp_path: Path, monkeypatch) -> None:
    """Two files that differ only in their last chunk's last byte have different digests."""
    import hashlib

    monkeypatch.setattr(ckpt, "CHUNK", 1024)
    data = bytes(range(256)) * 10  # 2.5 chunks
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(data[:-1] + b"\x00")
    assert ckpt.file_digest(tmp_path / "a") == hashlib.sha256(data).hexdigest()
    assert ckpt.file_digest(tmp_path / "a") != ckpt.file_digest(tmp_path / "b")
