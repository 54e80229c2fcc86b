"""Experiment trackers: the run's records also go to TensorBoard, Weights & Biases, MLflow or
a tracker of the user's own, on rank 0 only.

A tracker is any object with the three methods of `Tracker`. `start` gets the run (its
directory, name, resolved configuration as hyperparameters, the step it starts from, and
what `start` returned when this run directory last started) and returns what identifies
its run; that is saved in `<run-dir>/trackers.json`, so a resumed run (a requeue, a
restart) continues the same TensorBoard directory, W&B run id and MLflow run id.

The built-in ones are offline by default: TensorBoard and MLflow write under the run
directory (MLflow to `MLFLOW_TRACKING_URI` where that is set), W&B runs in offline mode
unless `WANDB_MODE` says otherwise. Each one's package is an optional extra; a missing
package or a tracker that fails to start is a one-line error before step 0. A tracker that
fails later, mid-run, is dropped with a warning: a lost dashboard must not stop training.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ddp_amp.distributed import on_rank_zero
from ddp_amp.durable import write_atomic
from ddp_amp.errors import UsageError

TRACKERS_FILE = "trackers.json"


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told when it starts."""

    run_dir: Path
    name: str  # the run directory's name
    config: dict[str, Any]  # the resolved configuration: the run's hyperparameters
    start_step: int  # 0 for a fresh run, else the step the run resumes from
    saved: dict[str, str] = field(default_factory=dict)  # what start() returned last time, on a resume


class Tracker(Protocol):
    """What a tracker implements; `--tracker package.module:function` names a function that
    returns one."""

    def start(self, run: TrackedRun) -> dict[str, str]:
        """Open (or reopen, from `run.saved`) the tracker's run; return what identifies it."""

    def log(self, values: dict[str, float], step: int) -> None:
        """Record `values` (numbers only) at optimizer step `step`."""

    def finish(self) -> None:
        """Flush and close."""


def _needs(module: str, tracker: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise UsageError("--tracker", tracker, f"the package {module.split('.')[0]!r} installed ({error})",
                         f"pip install 'ddp_amp[{extra}]'") from None


def _flat_params(config: Mapping[str, Any]) -> dict[str, str]:
    """Hyperparameters as strings: what MLflow's params and TensorBoard's text take."""
    return {key: json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
            for key, value in sorted(config.items())}


class TensorBoardTracker:
    """Event files in `<run-dir>/tensorboard`; a resume purges what a lost attempt wrote
    past the step it resumes from, as metrics.jsonl does."""

    def start(self, run: TrackedRun) -> dict[str, str]:
        tensorboard = _needs("torch.utils.tensorboard", "tensorboard", "tensorboard")
        log_dir = run.run_dir / "tensorboard"
        self.writer = tensorboard.SummaryWriter(str(log_dir), purge_step=run.start_step + 1 if run.start_step else None)
        if not run.start_step:
            self.writer.add_text("config", "\n".join(f"    {k} = {v}" for k, v in _flat_params(run.config).items()))
        return {"log_dir": str(log_dir)}

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def finish(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in `<run-dir>/wandb`, offline unless WANDB_MODE is set; the same run id on a
    resume (`resume="allow"`)."""

    def start(self, run: TrackedRun) -> dict[str, str]:
        wandb = _needs("wandb", "wandb", "wandb")
        run_id = run.saved.get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(id=run_id, resume="allow", name=run.name, config=run.config, dir=str(run.run_dir),
                              project=os.environ.get("WANDB_PROJECT", "ddp_amp"),
                              mode=os.environ.get("WANDB_MODE", "offline"))
        return {"id": run_id}

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run at MLFLOW_TRACKING_URI, else in a file store in `<run-dir>/mlruns`; the
    same run id on a resume. The file store needs MLFLOW_ALLOW_FILE_STORE (MLflow keeps it
    in maintenance): set here for the default store only."""

    def start(self, run: TrackedRun) -> dict[str, str]:
        mlflow = _needs("mlflow", "mlflow", "mlflow")
        uri = run.saved.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") \
            or (run.run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        self.metric = mlflow.entities.Metric
        run_id = run.saved.get("run_id")
        if run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ddp_amp")
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
            params = [mlflow.entities.Param(k, v[:6000]) for k, v in _flat_params(run.config).items()]
            self.client.log_batch(run_id, params=params)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return {"run_id": run_id, "tracking_uri": uri}

    def log(self, values: dict[str, float], step: int) -> None:
        stamp = int(1000 * __import__("time").time())
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, stamp, step) for k, v in values.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


BUILT_IN: dict[str, Callable[[], Tracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def check_tracker_spec(spec: str) -> None:
    """Raise a one-line UsageError unless `spec` names a built-in tracker or has the form
    `package.module:function` (checked with the options, before anything starts)."""
    if spec not in BUILT_IN and ":" not in spec:
        near = difflib.get_close_matches(spec, BUILT_IN, n=1)
        raise UsageError("--tracker", spec, f"one of {', '.join(BUILT_IN)} or 'package.module:function'",
                         f"did you mean {near[0]}?" if near else "e.g. --tracker tensorboard,wandb")


def make_tracker(spec: str) -> Tracker:
    """A built-in tracker by name, or the one `package.module:function` returns."""
    check_tracker_spec(spec)
    if spec in BUILT_IN:
        return BUILT_IN[spec]()
    module_name, _, function_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise UsageError("--tracker", spec, f"an importable function ({error})",
                         "check the module is on PYTHONPATH and the name after the colon") from None
    tracker = factory()
    missing = [name for name in ("start", "log", "finish") if not callable(getattr(tracker, name, None))]
    if missing:
        raise UsageError("--tracker", spec, f"a tracker with start(), log() and finish(); it has no {missing[0]}()",
                         "see ddp_amp.metrics.trackers.Tracker")
    return tracker


def numbers_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, without its step: what trackers are given."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class Trackers:
    """The run's started trackers (rank 0): records in, failures mid-run dropped with a warning."""

    def __init__(self, started: dict[str, Tracker], warn: Callable[[str], None]) -> None:
        self.started, self.warn = started, warn

    def log(self, record: Mapping[str, Any], step: int) -> None:
        values = numbers_of(record)
        if not values:
            return
        for spec, tracker in list(self.started.items()):
            try:
                tracker.log(values, step)
            except Exception as error:  # noqa: BLE001 - a dashboard's failure must not stop training
                self.warn(f"tracker {spec} failed and is dropped: {type(error).__name__}: {error}")
                del self.started[spec]

    def finish(self) -> None:
        for spec, tracker in self.started.items():
            try:
                tracker.finish()
            except Exception as error:  # noqa: BLE001 - the run's own records are written already
                self.warn(f"tracker {spec} failed to finish: {type(error).__name__}: {error}")
        self.started = {}


def start_trackers(specs: list[str], run_dir: Path, config: dict[str, Any], start_step: int,
                   warn: Callable[[str], None]) -> Trackers:
    """Start each tracker in `specs` for the run in `run_dir` (rank 0 only), continuing the
    runs recorded in trackers.json when `start_step` > 0; raise UsageError if one fails."""
    path = run_dir / TRACKERS_FILE
    saved = json.loads(path.read_text()) if start_step and path.is_file() else {}
    started: dict[str, Tracker] = {}
    identities: dict[str, dict[str, str]] = {}
    try:
        for spec in specs:
            tracker = make_tracker(spec)
            run = TrackedRun(run_dir, run_dir.name, config, start_step, dict(saved.get(spec, {})))
            try:
                identities[spec] = dict(tracker.start(run) or {})
            except UsageError:
                raise
            except Exception as error:  # any failure to start is the user's to see, in one line
                raise UsageError("--tracker", spec, f"a tracker that starts ({type(error).__name__}: "
                                 f"{str(error).splitlines()[0] if str(error) else ''})",
                                 "check its settings, or leave it out of --tracker") from error
            started[spec] = tracker
    except BaseException:
        Trackers(started, warn).finish()
        raise
    write_atomic(path, json.dumps({**saved, **identities}, indent=2).encode())
    return Trackers(started, warn)


def start_trackers_on_rank_zero(specs: list[str], run_dir: Path, config: dict[str, Any], start_step: int,
                                warn: Callable[[str], None]) -> Trackers:
    """`start_trackers` on rank 0, which makes `run_dir` if needed; the other ranks get an empty
    set (collective: a tracker that fails to start raises on every rank)."""
    started = Trackers({}, warn)

    def start() -> None:
        nonlocal started
        run_dir.mkdir(parents=True, exist_ok=True)
        started = start_trackers(specs, run_dir, config, start_step, warn)

    on_rank_zero(start)
    return started
