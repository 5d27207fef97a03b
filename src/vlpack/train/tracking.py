"""Experiment tracking (`train.report_to`): rank 0 mirrors every metrics row to TensorBoard,
Weights & Biases, MLflow or trackio, with the run's config. `metrics.jsonl` stays the source of
truth; a tracker receives the same keys (numbers only) at the row's step.

Each tracker is an optional extra (`pip install "vlpack[tensorboard]"` and so on), imported only
when a run asks for it. Where each one writes:

- tensorboard: OUTPUT_DIR/tensorboard (a resumed run purges the events past its step), the
  config as text under `config`.
- wandb: project `$WANDB_PROJECT` (default `vlpack`), run id = the vlpack run's id (a resumed
  run continues the same W&B run), files under OUTPUT_DIR/wandb; `WANDB_MODE=offline` works.
- mlflow: the experiment and server of `$MLFLOW_EXPERIMENT_NAME` / `$MLFLOW_TRACKING_URI`
  (mlflow's defaults otherwise); the config as flattened params.
- trackio: project `$TRACKIO_PROJECT` (default `vlpack`), run named after the output folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import yaml

TrackerName = Literal["tensorboard", "wandb", "mlflow", "trackio"]
TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow", "trackio")
MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow",
           "trackio": "trackio"}
"""The module each tracker imports; its extra has the tracker's name."""


def _missing(name: str, why: str) -> ValueError:
    return ValueError(f"train.report_to lists {name}, which is not installed ({why}): install it "
                      f'with pip install "vlpack[{name}]" or drop {name} from train.report_to')


def check_installed(names: list[str]) -> None:
    """ValueError naming the extra of the first tracker that is not installed (without importing
    any: every rank checks, so no rank starts a run that rank 0 then refuses)."""
    for name in names:
        if importlib.util.find_spec(name) is None:  # the package the tracker's extra installs
            raise _missing(name, f"no module named {name!r}")


def require(name: str) -> Any:
    """Import the tracker's module, or a ValueError naming the extra that installs it."""
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
    """One tracker: `__call__(row)` mirrors a metrics row, `close()` flushes and ends the run."""

    def __call__(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    def __init__(self, out_dir: Path, config: dict[str, Any], resume_step: int) -> None:
        tb = require("tensorboard")
        self.writer = tb.SummaryWriter(log_dir=str(out_dir / "tensorboard"),
                                       purge_step=resume_step + 1 if resume_step else None)
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```")

    def __call__(self, row: dict[str, Any]) -> None:
        for k, v in numbers(row).items():
            self.writer.add_scalar(k, v, global_step=row["step"], walltime=row.get("time"))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    def __init__(self, out_dir: Path, config: dict[str, Any], run_id: str | None) -> None:
        wandb = require("wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "vlpack"), name=out_dir.name,
                              id=run_id, resume="allow", config=config, dir=str(out_dir))

    def __call__(self, row: dict[str, Any]) -> None:
        self.run.log(numbers(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    def __init__(self, out_dir: Path, config: dict[str, Any], run_id: str | None) -> None:
        self.mlflow = require("mlflow")
        self.mlflow.start_run(run_name=out_dir.name, tags={"vlpack.run_id": run_id or ""})
        self.mlflow.log_params({k: str(v) for k, v in flatten(config).items()})

    def __call__(self, row: dict[str, Any]) -> None:
        self.mlflow.log_metrics(numbers(row), step=row["step"])

    def close(self) -> None:
        self.mlflow.end_run()


class Trackio(Tracker):
    def __init__(self, out_dir: Path, config: dict[str, Any]) -> None:
        self.trackio = require("trackio")
        self.trackio.init(project=os.environ.get("TRACKIO_PROJECT", "vlpack"), name=out_dir.name,
                          config=config, resume="allow")

    def __call__(self, row: dict[str, Any]) -> None:
        self.trackio.log(numbers(row), step=row["step"])

    def close(self) -> None:
        self.trackio.finish()


def build_trackers(names: list[str], *, out_dir: str | Path, config: dict[str, Any],
                   run_id: str | None = None, resume_step: int = 0) -> list[Tracker]:
    """The trackers `train.report_to` names (call on rank 0 only); a missing extra is a
    ValueError before any of them starts."""
    check_installed(names)
    out_dir = Path(out_dir)
    made: dict[str, Any] = {
        "tensorboard": lambda: TensorBoard(out_dir, config, resume_step),
        "wandb": lambda: WandB(out_dir, config, run_id),
        "mlflow": lambda: MLflow(out_dir, config, run_id),
        "trackio": lambda: Trackio(out_dir, config),
    }
    return [made[name]() for name in names]
