"""train.report_to: every metrics row mirrored to the trackers with the run's config, read back
from what each tracker wrote (TensorBoard's event file, W&B's offline run file)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from vlpack.train import tracking
from vlpack.train.metrics import MetricsWriter
from vlpack.train.tracking import build_trackers, numbers

CONFIG = {"optim": {"lr": 1e-5}, "train": {"report_to": ["tensorboard"]}}
ROWS = [{"step": 1, "loss": 2.5, "lr": 1e-5, "aux_loss": None, "time": 1.0e9, "samples": 4},
        {"step": 2, "loss": 2.25, "lr": 2e-5, "aux_loss": None, "time": 1.0e9 + 5, "samples": 8},
        {"step": 2, "samples": 8, "eval_loss": 2.75, "eval_s": 0.5}]


def _write(out: Path, names: list[str], rows: list[dict], *, resume_step: int = 0, run_id="r1") -> None:
    out.mkdir(exist_ok=True)
    trackers = build_trackers(names, out_dir=out, config=CONFIG, run_id=run_id, resume_step=resume_step)
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
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "vlpack-test")
    _write(tmp_path, ["wandb"], ROWS, run_id="run123")
    (path,) = (tmp_path / "wandb").glob("offline-run-*-run123/run-run123.wandb")
    records = _wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == ("run123", "vlpack-test", tmp_path.name)
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["optim"] == {"lr": 1e-5} and config["train"] == {"report_to": ["tensorboard"]}
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    got = [{k: v for k, v in h.items() if not k.startswith("_") or k == "_step"} for h in history]
    assert got == [{"_step": 1, "loss": 2.5, "lr": 1e-5, "samples": 4},
                   {"_step": 2, "loss": 2.25, "lr": 2e-5, "samples": 8, "eval_loss": 2.75, "eval_s": 0.5}]


def test_a_missing_tracker_names_its_extra(monkeypatch) -> None:
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r'report_to lists mlflow, which is not installed .*'
                                         r'pip install "vlpack\[mlflow\]" or drop mlflow'):
        tracking.check_installed(["tensorboard", "mlflow"][1:])


def test_mlflow_run_reads_back(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3: the file store needs it
    _write(tmp_path / "run", ["mlflow"], ROWS, run_id="run123")
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert (run.info.run_name, run.data.tags["vlpack.run_id"]) == ("run", "run123")
    assert run.data.params == {"optim.lr": "1e-05", "train.report_to": "['tensorboard']"}
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
               for k in ("loss", "eval_loss", "samples")}
    assert history == {"loss": [(1, 2.5), (2, 2.25)], "eval_loss": [(2, 2.75)],
                       "samples": [(1, 4.0), (2, 8.0), (2, 8.0)]}
