"""When the task's LR scheduler is stepped: `Task.schedule_on`.

- `"step"`: once per optimizer step *taken* (fp16 skips do not advance it), without a host
  sync per step (lr_steps.py). Warm-up and cosine schedules.
- `"epoch"`: once per completed pass over the training data (an epoch boundary inside an
  accumulated step counts at the end of that step). StepLR-style decays by epoch.
- `"eval:METRIC"`: after each evaluation during training, with that eval metric (e.g.
  `ReduceLROnPlateau` on `eval_nll`); the evaluation before the first step does not count.

The scheduler's state is in every checkpoint; where the epoch cadence stands is derived
from the data position, so a resume steps it exactly as a straight run does.
"""

from __future__ import annotations

from typing import Any

from ddp_amp.session import AgreedGradScaler
from ddp_amp.data import Stream
from ddp_amp.trainer.evaluation import metric_of
from ddp_amp.trainer.lr_steps import TakenStepScheduler


def _completed_epochs(stream: Stream) -> int:
    if stream.batches_per_epoch is None:  # a pass of unknown length: over when the next one starts
        return stream.epoch
    return stream.epoch + (1 if stream.batch_in_epoch >= stream.batches_per_epoch else 0)


class SchedulerDriver:
    """Steps `scheduler` at the task's cadence; the Trainer calls every hook, each does its part."""

    def __init__(self, scheduler: Any, scaler: AgreedGradScaler, schedule_on: str, stream: Stream) -> None:
        self.scheduler, self.stream = scheduler, stream
        self.kind, _, self.metric = schedule_on.partition(":")
        self.per_step = TakenStepScheduler(scheduler, scaler) if self.kind == "step" else None
        self._epochs_stepped = _completed_epochs(stream)

    def before_step(self) -> None:
        """Before each optimizer step."""
        if self.per_step is not None:
            self.per_step.before_step()

    def before_log(self) -> float:
        """On a log step: the LR to log (the first group's), settling a per-step plan there."""
        if self.per_step is None:
            return float(self.scheduler.optimizer.param_groups[0]["lr"])
        self.per_step.before_log()
        return self.per_step.logged_lr()

    def after_step(self) -> None:
        """After each optimizer step (and its scaler update)."""
        if self.per_step is not None:
            self.per_step.after_step()
        elif self.kind == "epoch":
            while self._epochs_stepped < _completed_epochs(self.stream):
                self.scheduler.step()
                self._epochs_stepped += 1

    def after_eval(self, record: dict[str, Any]) -> None:
        """After an evaluation logged as `record` (eval metrics are the same on every rank)."""
        if self.kind != "eval":
            return
        value = metric_of(record, self.metric, "Task.schedule_on", f"eval:{self.metric}",
                          "schedule_on='eval:{name}'")
        if record.get("step", 0) > 0:
            self.scheduler.step(value)

    def before_checkpoint(self) -> None:
        if self.per_step is not None:  # the scheduler's state must be exact from here on
            self.per_step.settle()

    def after_load(self) -> None:
        """After the scheduler's and the data position's state were loaded from a checkpoint."""
        if self.per_step is not None:
            self.per_step.mark_exact()
        self._epochs_stepped = _completed_epochs(self.stream)

