"""train.report_to: every metrics row mirrored to the trackers with the run's config, read back
from what each tracker wrote (TensorBoard's event file, W&B's offline run file, MLflow's default
SQLite store); a tracker that cannot start ends the run before the model is built."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import CPU, small_cfg
from vlpack.train import trainer
from vlpack.train.run import checkpoint as ckpt
from vlpack.train.run import tracking
from vlpack.train.run.metrics import MetricsWriter
from vlpack.train.run.tracking import numbers, start_trackers
from vlpack.train.trainer import Trainer

CONFIG = {"optim": {"lr": 1e-5}, "train": {"report_to": ["tensorboard"]}}
ROWS = [{"step": 1, "loss": 2.5, "lr": 1e-5, "aux_loss": None, "time": 1.0e9, "samples": 4},
        {"step": 2, "loss": 2.25, "lr": 2e-5, "aux_loss": None, "time": 1.0e9 + 5, "samples": 8},
        {"step": 2, "samples": 8, "eval_loss": 2.75, "eval_s": 0.5}]


def _write(out: Path, names: list[str], rows: list[dict], *, resume_step: int = 0, run_id="r1") -> None:
    out.mkdir(exist_ok=True)
    trackers = start_trackers(names, out_dir=out, run_id=run_id)
    for t in trackers:
        t.begin(CONFIG, resume_step)
    writer = MetricsWriter(out / "metrics.jsonl", resume_step=resume_step, mirrors=tuple(trackers))
    for row in rows:
        writer.write(row)
    writer.close()
    for t in trackers:
        t.close()


def test_numbers_drop_the_axes_and_the_missing() -> None:
    assert numbers({"step": 3, "time": 1.0, "loss": 2, "aux_loss": None, "ok": True, "mfu": 0.5}) == {
        "loss": 2.0, "mfu": 0.5}


def test_tensorboard_event_file_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read() -> tuple[EventAccumulator, dict[str, list]]:
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return acc, {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    _write(tmp_path, ["tensorboard"], ROWS)
    acc, scalars = read()
    assert scalars["loss"] == [(1, 2.5), (2, 2.25)]
    assert scalars["lr"] == [(1, pytest.approx(1e-5)), (2, pytest.approx(2e-5))]
    assert scalars["samples"] == [(1, 4.0), (2, 8.0), (2, 8.0)]  # a training and an eval row
    assert scalars["eval_loss"] == [(2, 2.75)] and scalars["eval_s"] == [(2, 0.5)]
    assert "aux_loss" not in scalars and "time" not in scalars and "step" not in scalars
    assert acc.Scalars("loss")[1].wall_time == 1.0e9 + 5
    (text,) = {e.tensor_proto.string_val[0].decode() for e in acc.Tensors("config/text_summary")}
    assert "lr: 1.0e-05" in text and "report_to:\n  - tensorboard" in text

    # a run resumed from step 1 writes step 2 again: the reader drops the old step 2 (eval too)
    _write(tmp_path, ["tensorboard"], [{"step": 2, "loss": 2.0, "lr": 2e-5}], resume_step=1)
    _, scalars = read()
    assert scalars["loss"] == [(1, 2.5), (2, 2.0)] and scalars["eval_loss"] == []


def _wandb_records(path: Path) -> list:
    """The records of a W&B run file (a LevelDB-style log: 7-byte file header, 32 KiB blocks,
    each record chunk with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle /
    4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            out.append(record)
            chunks = b""
    return out


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    from google.protobuf.message import DecodeError

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "vlpack-test")
    _write(tmp_path, ["wandb"], ROWS, run_id="run123")
    # wandb's service process writes the run's file on its own, and can still be writing it
    # after finish() returns (seen in one of three runs beside the other tests): read it once
    # it holds the exit record that ends a run
    deadline = time.monotonic() + 60
    while True:
        found = sorted((tmp_path / "wandb").glob("offline-run-*-run123/run-run123.wandb"))
        try:  # a file still being written may end inside its header or a record
            records = _wandb_records(found[0]) if len(found) == 1 else []
        except (AssertionError, ValueError, struct.error, DecodeError):
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(found) == 1, found
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == ("run123", "vlpack-test", tmp_path.name)
    config = {u.key: json.loads(u.value_json) for r in records
              if r.WhichOneof("record_type") == "config" for u in r.config.update}
    assert config["optim"] == {"lr": 1e-5} and config["train"] == {"report_to": ["tensorboard"]}
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    got = [{k: v for k, v in h.items() if not k.startswith("_") or k == "_step"} for h in history]
    assert got == [{"_step": 1, "loss": 2.5, "lr": 1e-5, "samples": 4},
                   {"_step": 2, "loss": 2.25, "lr": 2e-5, "samples": 8, "eval_loss": 2.75, "eval_s": 0.5}]


def test_a_missing_tracker_names_its_extra(monkeypatch, caplog) -> None:
    real = tracking.importlib.import_module
    monkeypatch.setattr(tracking.importlib, "import_module", lambda name: (
        (_ for _ in ()).throw(ImportError("No module named 'trackio'")) if name == "trackio"
        else real(name)))
    with pytest.raises(ValueError, match=r'report_to lists trackio, which is not installed .*'
                                         r'pip install "vlpack\[trackio\]" or drop trackio'):
        start_trackers(["trackio"], out_dir=".")
    assert start_trackers(["trackio"], out_dir=".", errors="warn") == []
    assert "report_to lists trackio, which is not installed" in caplog.text
    assert "training without it (train.report_to_errors=warn)" in caplog.text


def test_mlflow_default_store_reads_back(tmp_path: Path, monkeypatch) -> None:
    """No MLFLOW_TRACKING_URI: a SQLite store in the output folder, nothing in the cwd."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "run", ["mlflow"], ROWS, run_id="run123")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("vlpack").experiment_id])
    assert (run.info.run_name, run.data.tags["vlpack.run_id"], run.info.status) == (
        "run", "run123", "FINISHED")
    assert run.data.params == {"optim.lr": "1e-05", "train.report_to": "['tensorboard']"}
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
               for k in ("loss", "eval_loss", "samples")}
    assert history == {"loss": [(1, 2.5), (2, 2.25)], "eval_loss": [(2, 2.75)],
                       "samples": [(1, 4.0), (2, 8.0), (2, 8.0)]}


TRACKIO_RUN = """
import json, sys
from pathlib import Path
from tests.train.run.test_tracking import CONFIG, ROWS, _write
from trackio.sqlite_storage import SQLiteStorage

_write(Path(sys.argv[1]), ["trackio"], ROWS)
print(json.dumps([SQLiteStorage.get_logs("vlpack-test", "run"),
                  SQLiteStorage.get_run_config("vlpack-test", "run")]))
"""


def test_trackio_local_project_reads_back(tmp_path: Path) -> None:
    """trackio's local store (its folder is read at import: a fresh process with TRACKIO_DIR)."""
    pytest.importorskip("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "vlpack-test"}
    done = subprocess.run([sys.executable, "-c", TRACKIO_RUN, str(tmp_path / "run")], env=env,
                          cwd=Path(__file__).parents[3], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    logs, config = json.loads(done.stdout.splitlines()[-1])
    assert [{k: v for k, v in r.items() if k != "timestamp"} for r in logs] == [
        {"step": 1, "loss": 2.5, "lr": 1e-5, "samples": 4},
        {"step": 2, "loss": 2.25, "lr": 2e-5, "samples": 8},
        {"step": 2, "samples": 8, "eval_loss": 2.75, "eval_s": 0.5}]
    assert config["optim"] == {"lr": 1e-5} and config["train"] == {"report_to": ["tensorboard"]}


def _no_build(*args, **kwargs):
    raise AssertionError("the model was built although a tracker could not start")


def test_a_tracker_that_cannot_start_ends_the_run_before_the_model_is_built(
        tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    monkeypatch.setattr(trainer, "build_stack", _no_build)
    cfg = small_cfg(tmp_path, "train.report_to=[tensorboard,mlflow]")
    with pytest.raises(ValueError, match=r"train\.report_to: mlflow could not start \(.*bogus.*\)\. "
                                         r"Fix: point MLFLOW_TRACKING_URI at .*; or drop mlflow from "
                                         r"train\.report_to \(train\.report_to_errors=warn trains "
                                         r"without it\)"):
        Trainer(cfg, CPU)


def test_report_to_errors_warn_trains_without_the_tracker(tmp_path: Path, monkeypatch, caplog) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    summary = Trainer(small_cfg(tmp_path, "train.max_steps=2", "train.report_to=[mlflow,tensorboard]",
                                "train.report_to_errors=warn"), CPU).fit()
    assert summary["steps"] == 2
    assert "train.report_to: mlflow could not start" in caplog.text
    assert "training without it (train.report_to_errors=warn)" in caplog.text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]


def test_mlflow_end_to_end_with_resume(tmp_path: Path, monkeypatch) -> None:
    """vlpack train with report_to=[mlflow] and no MLflow settings: OUTPUT_DIR/mlflow.db holds
    every metrics row; the resumed run is a second MLflow run tagged with the same run id, with
    the config as trained."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    for steps in (2, 3):
        Trainer(small_cfg(tmp_path, f"train.max_steps={steps}", "train.report_to=[mlflow]"), CPU).fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    run_id = ckpt.marker(ckpt.latest_checkpoint(tmp_path))["run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("vlpack").experiment_id],
                              order_by=["attributes.start_time ASC"])
    assert [r.data.tags["vlpack.run_id"] for r in runs] == [run_id, run_id]
    assert [r.data.params["train.max_steps"] for r in runs] == ["2", "3"]
    got = [(m.step, m.value) for r in runs for m in client.get_metric_history(r.info.run_id, "loss")]
    assert got == [(r["step"], pytest.approx(r["loss"])) for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
