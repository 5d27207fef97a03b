"""Experiment tracking (`train.report_to`): rank 0 mirrors every metrics row to TensorBoard,
Weights & Biases, MLflow or trackio, with the run's config. `metrics.jsonl` stays the source of
truth; a tracker receives the same keys (numbers only) at the row's step.

Each tracker is an optional extra (`pip install "vlpack[tensorboard]"` and so on), imported only
when a run asks for it. `start_trackers` starts them in `Trainer.__init__`, before the model is
built: a tracker that cannot start ends the run in seconds, naming the tracker, the error and the
fix (`train.report_to_errors=warn`: logged, and the run trains without it). Where each writes:

- tensorboard: OUTPUT_DIR/tensorboard (a resumed run purges the events past its step), the
  config as text under `config`.
- wandb: project `$WANDB_PROJECT` (default `vlpack`), run id = the vlpack run's id (a resumed
  run continues the same W&B run), files under OUTPUT_DIR/wandb; `WANDB_MODE=offline` works.
- mlflow: the server or store of `$MLFLOW_TRACKING_URI`, else a SQLite store
  OUTPUT_DIR/mlflow.db (artifacts under OUTPUT_DIR/mlartifacts); experiment
  `$MLFLOW_EXPERIMENT_NAME` (default `vlpack`); the config as flattened params.
- trackio: project `$TRACKIO_PROJECT` (default `vlpack`), run named after the output folder.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

if TYPE_CHECKING:
    from vlpack.train.distributed.parallel import Topology

log = logging.getLogger("vlpack.train")

TrackerName = Literal["tensorboard", "wandb", "mlflow", "trackio"]
TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow", "trackio")
MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow",
           "trackio": "trackio"}
"""The module each tracker imports; its extra has the tracker's name."""
FIXES = {
    "tensorboard": "check that OUTPUT_DIR/tensorboard is writable",
    "wandb": "log in (wandb login, or set WANDB_API_KEY) or set WANDB_MODE=offline",
    "mlflow": "point MLFLOW_TRACKING_URI at a reachable server or store (unset: a SQLite store "
              'OUTPUT_DIR/mlflow.db, which needs the full mlflow: pip install "vlpack[mlflow]")',
    "trackio": "check TRACKIO_PROJECT and trackio's server or Space settings",
}
"""What to try when a tracker that is installed fails to start."""


class TrackerMissingError(ValueError):
    """A tracker `train.report_to` lists is not installed; the message names its extra."""


def _missing(name: str, why: str) -> TrackerMissingError:
    return TrackerMissingError(f"train.report_to lists {name}, which is not installed ({why}): install "
                          f'it with pip install "vlpack[{name}]" or drop {name} from train.report_to')


def require(name: str) -> Any:
    """Import the tracker's module, or a TrackerMissingError naming the extra that installs it."""
    try:
        return importlib.import_module(MODULES[name])
    except ImportError as e:
        raise _missing(name, str(e)) from None


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric values a tracker plots (not `step` or `time`, which it has as axes)."""
    return {k: float(v) for k, v in row.items() if k not in ("step", "time")
            and isinstance(v, int | float) and not isinstance(v, bool)}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-5}} -> {"optim.lr": 1e-5}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


class Tracker:
    """One tracker. Its constructor starts it (import, connection, run); `begin(config, step)`
    records the run's config as trained and the step a resumed run continues from; `__call__(row)`
    mirrors a metrics row; `close()` flushes and ends the run."""

    def begin(self, config: dict[str, Any], resume_step: int) -> None:
        raise NotImplementedError

    def __call__(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    def __init__(self, out_dir: Path) -> None:
        self.writer = require("tensorboard").SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def begin(self, config: dict[str, Any], resume_step: int) -> None:
        if resume_step:  # what SummaryWriter(purge_step=resume_step + 1) writes: readers drop
            # the earlier events past the resumed step (the resumed run writes them anew)
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            self.writer._get_file_writer().add_event(
                Event(step=resume_step + 1, session_log=SessionLog(status=SessionLog.START)))
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```")

    def __call__(self, row: dict[str, Any]) -> None:
        for k, v in numbers(row).items():
            self.writer.add_scalar(k, v, global_step=row["step"], walltime=row.get("time"))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    def __init__(self, out_dir: Path, run_id: str | None) -> None:
        wandb = require("wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "vlpack"), name=out_dir.name,
                              id=run_id, resume="allow", dir=str(out_dir))

    def begin(self, config: dict[str, Any], resume_step: int) -> None:
        self.run.config.update(config, allow_val_change=True)

    def __call__(self, row: dict[str, Any]) -> None:
        self.run.log(numbers(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    """Through a client bound to its store: no process-wide active run."""

    def __init__(self, out_dir: Path, run_id: str | None) -> None:
        mlflow = require("mlflow")
        from mlflow.entities import Metric, Param

        self.Metric, self.Param = Metric, Param
        default = not os.environ.get("MLFLOW_TRACKING_URI")
        uri = f"sqlite:///{out_dir.resolve() / 'mlflow.db'}" if default else None
        self.client = mlflow.MlflowClient(tracking_uri=uri)  # None: $MLFLOW_TRACKING_URI
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "vlpack")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            name, artifact_location=(out_dir.resolve() / "mlartifacts").as_uri() if default else None)
        self.run_id = self.client.create_run(experiment_id, run_name=out_dir.name,
                                             tags={"vlpack.run_id": run_id or ""}).info.run_id

    def begin(self, config: dict[str, Any], resume_step: int) -> None:
        self.client.log_batch(self.run_id, params=[self.Param(k, str(v))
                                                   for k, v in flatten(config).items()])

    def __call__(self, row: dict[str, Any]) -> None:
        ms = int(1000 * row.get("time", time.time()))
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, ms, row["step"])
                                                    for k, v in numbers(row).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio(Tracker):
    def __init__(self, out_dir: Path) -> None:
        self.trackio = require("trackio")
        self.run = self.trackio.init(project=os.environ.get("TRACKIO_PROJECT", "vlpack"),
                                     name=out_dir.name, resume="allow")

    def begin(self, config: dict[str, Any], resume_step: int) -> None:
        self.run.config.update(config)  # sent with the first row

    def __call__(self, row: dict[str, Any]) -> None:
        self.trackio.log(numbers(row), step=row["step"])

    def close(self) -> None:
        self.trackio.finish()


def _failed(name: str, e: Exception) -> str:
    why = " ".join(f"{type(e).__name__}: {e}".split())
    why = why if len(why) <= 400 else why[:400] + " …"
    return (f"train.report_to: {name} could not start ({why}). Fix: {FIXES[name]}; or drop {name} "
            "from train.report_to")


def _start(names: list[str], out_dir: Path, run_id: str | None,
           errors: Literal["error", "warn"]) -> list[Tracker]:
    """This process's trackers; the first that cannot start raises (the started ones closed),
    or with `warn` is logged and left out."""
    made: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoard(out_dir),
        "wandb": lambda: WandB(out_dir, run_id),
        "mlflow": lambda: MLflow(out_dir, run_id),
        "trackio": lambda: Trackio(out_dir),
    }
    started: list[Tracker] = []
    for name in names:
        try:
            started.append(made[name]())
        except Exception as e:  # whatever the tracker's library raises
            problem = str(e) if isinstance(e, TrackerMissingError) else _failed(name, e)
            if errors == "warn":
                log.warning("%s; training without it (train.report_to_errors=warn)", problem)
                continue
            for tracker in started:
                tracker.close()
            raise ValueError(f"{problem} (train.report_to_errors=warn trains without it)") from None
    return started


def start_trackers(names: list[str], *, out_dir: str | Path, run_id: str | None = None,
                   errors: Literal["error", "warn"] = "error",
                   topo: Topology | None = None) -> list[Tracker]:
    """Start the trackers `train.report_to` names on rank 0 (none elsewhere), before the model
    is built. One that cannot start is a ValueError on every rank naming the tracker, the
    error and the fix (collective under torchrun); with `errors="warn"` it is logged and left
    out. Each tracker's `begin(config, resume_step)` follows once the run's config is final and
    its checkpoint, if any, has loaded."""
    from vlpack.train.distributed.parallel import broadcast_object

    trackers: list[Tracker] = []
    error = None
    if topo is None or topo.is_main:
        try:
            trackers = _start(names, Path(out_dir), run_id, errors)
        except ValueError as e:
            error = str(e)
    if topo is not None:
        error = broadcast_object(error, topo)
    if error is not None:
        raise ValueError(error)
    return trackers
