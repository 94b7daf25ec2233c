"""Experiment trackers beside metrics.jsonl (`report_to=`): TensorBoard, Weights & Biases, Trackio, MLflow.

`report_to` takes a list (`report_to=wandb,tensorboard`). Rank 0 opens each once the checkpoint (if
any) is read, logs the run's config once, and then every metrics.jsonl row under the same names at
its step (`Trackers.write`). metrics.jsonl stays the record; these are second sinks:

- `tensorboard`: event files in `out/tensorboard/` (the `tensorboard` extra); a resume purges the
  events after the checkpoint's step, so the curves hold each step once.
- `wandb`: a Weights & Biases run (`wandb` extra), project `$WANDB_PROJECT` (default minitrain), named
  after the out folder, its files under `out/wandb/`; `WANDB_MODE=offline` keeps it on disk.
- `trackio`: a Trackio run in its local store (`$TRACKIO_DIR`, default `~/.cache/huggingface/trackio`;
  `trackio` extra), project `$TRACKIO_PROJECT` (default minitrain), named after the out folder.
- `mlflow`: an MLflow run (`mlflow` extra) at `$MLFLOW_TRACKING_URI` (default: mlflow's, `./mlruns`),
  experiment `$MLFLOW_EXPERIMENT_NAME` (default minitrain); the config as params, the rows as metrics.

A resumed run continues the same tracker run: each tracker's run id is kept in the checkpoint
(`state.json`, "trackers") and handed back when `resume=true` opens it (wandb `resume="allow"`, the
same MLflow run, Trackio's run of that name). Rows logged after the checkpoint by the interrupted
launch stay in wandb / MLflow / Trackio (only TensorBoard can purge them); the resumed launch logs
those steps again.

A tracker whose package is missing is refused before anything loads (`check`: a user mistake). One
that fails while the run goes on (offline, a wrong URI, a server that stops answering) is one
`warning:` line naming it, and the run continues without it; MLflow's HTTP retries are bounded
(`MLFLOW_HTTP_REQUEST_MAX_RETRIES` 2 and `_TIMEOUT` 20 s unless set) so a dead server costs seconds.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from minitrain.errors import UserError

SINKS = ("none", "tensorboard", "wandb", "trackio", "mlflow")
PROJECT = "minitrain"  # the default project / experiment name


def check(report_to: list[str]) -> None:
    """Refuse an unknown tracker or one whose package is missing, before anything loads."""
    for name in report_to:
        if name not in SINKS:
            raise UserError(f"report_to={','.join(report_to)}: {name!r} is not a tracker — use any of "
                            f"{', '.join(SINKS[1:])} (comma-separated), or none")
        if name != "none" and importlib.util.find_spec(name) is None:
            raise UserError(f"report_to={name}: the {name} package is not installed — pip install -e \".[{name}]\", "
                            f"or drop it from report_to (metrics.jsonl is always written)")


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (what a tracker plots), the step left out."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoard:
    """Scalars into `out/tensorboard/`; events after the resumed step are purged."""

    def __init__(self, out: Path, config: dict[str, Any], start_step: int, resume_id: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        self.id = None

    def write(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, out: Path, config: dict[str, Any], start_step: int, resume_id: str | None):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=out.name, dir=str(out),
                              config=config, id=resume_id, resume="allow" if resume_id else None,
                              settings=wandb.Settings(init_timeout=60, console="off", silent=True))
        self.id = self.run.id

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, out: Path, config: dict[str, Any], start_step: int, resume_id: str | None):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=resume_id or out.name,
                                config=config, resume="must" if resume_id else "allow", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)
        self.id = self.run.name

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, out: Path, config: dict[str, Any], start_step: int, resume_id: str | None):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient()
        if resume_id:
            self.id = self.client.get_run(resume_id).info.run_id
            self.client.update_run(self.id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.id = self.client.create_run(experiment, run_name=out.name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in config.items()]
            for i in range(0, len(params), 100):  # (a batch takes at most 100 params)
                self.client.log_batch(self.id, params=params[i:i + 100])

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.id)


OPENERS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio, "mlflow": MLflow}


class Trackers:
    """The trackers of `report_to`, each dropped with one warning the first time it fails."""

    def __init__(self, report_to: list[str], out: Path, config: dict[str, Any], start_step: int,
                 resume_ids: dict[str, str] | None, warn: Callable[[str], None]):
        check(report_to)
        self.warn = warn
        self.open: dict[str, Any] = {}
        for name in dict.fromkeys(n for n in report_to if n != "none"):
            self._guard(name, lambda n=name: self.open.__setitem__(
                n, OPENERS[n](out, config, start_step, (resume_ids or {}).get(n))), opening=True)

    def _guard(self, name: str, call: Callable[[], Any], opening: bool = False) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 -- any failure of a tracker: said once, training goes on
            self.open.pop(name, None)
            self.warn(f"warning: report_to={name}: {'could not start' if opening else 'stopped'} "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}) — training goes on without "
                      f"it; metrics.jsonl keeps every row")

    def ids(self) -> dict[str, str]:
        """Each open tracker's run id, for the checkpoint (a resume continues these runs)."""
        return {n: t.id for n, t in self.open.items() if t.id is not None}

    def write(self, row: dict[str, Any]) -> None:
        step, values = int(row["step"]), _numbers(row)
        for name, tracker in list(self.open.items()):
            self._guard(name, lambda t=tracker: t.write(step, values))

    def close(self) -> None:
        for name, tracker in list(self.open.items()):
            self._guard(name, tracker.close)
        self.open.clear()
