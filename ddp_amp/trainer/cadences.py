"""What the Trainer does between optimizer steps, each on its own cadence.

Each component is called after every step with the step number and its loss (a device
tensor), decides whether this step is its step, and does its part: evaluate, log, save, or
stop for a preemption. The loop calls them in one list, in this order, so a logged step
shows the evaluation of the same step and a checkpoint follows its log line. A component
that returns a record ends training with it (only the preemption one does).

Every component is collective on its steps, and every rank reaches the same decision: the
cadences are step counts from the options, and the preemption check agrees across ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ddp_amp.guards import PreemptionWatch


class Cadence(Protocol):
    def after_step(self, step: int, loss: torch.Tensor) -> dict[str, Any] | None:
        """Do this component's part after optimizer step `step`; a record ends training."""


class StepClock:
    """Wall time of training since the last log line, evaluations left out, and in total."""

    def __init__(self, step: int, samples_seen: int) -> None:
        self.started = self.window_start = time.perf_counter()
        self.first_step, self.first_samples = step, samples_seen  # a resumed run counts from here
        self.window_step, self.window_samples = step, samples_seen

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation) out of the rates."""
        self.window_start += seconds

    def window(self, step: int, samples_seen: int) -> tuple[float, float]:
        """(samples/s, s/step) since the last call, which starts the next window."""
        now = time.perf_counter()
        seconds = max(now - self.window_start, 1e-9)
        rates = (samples_seen - self.window_samples) / seconds, seconds / max(step - self.window_step, 1)
        self.window_start, self.window_step, self.window_samples = now, step, samples_seen
        return rates

    def total(self, step: int, samples_seen: int) -> tuple[float, float, float]:
        """(samples/s, s/step, seconds) over everything this process trained."""
        elapsed = time.perf_counter() - self.started
        return ((samples_seen - self.first_samples) / max(elapsed, 1e-9),
                elapsed / max(step - self.first_step, 1), elapsed)


class Evaluation:
    """The task's metric every `every` steps (0: only at the end), and before the first step."""

    def __init__(self, every: int, evaluate: Callable[[], dict[str, Any]], clock: StepClock) -> None:
        self.every, self.evaluate, self.clock = every, evaluate, clock
        self.last: dict[str, Any] = {}  # the latest evaluation's record

    def before_training(self, step: int) -> None:
        # Where learning started, in the log; not after a resume: the interrupted run
        # logged the metric at that step if it was due.
        if self.every and step == 0:
            self.last = self.evaluate()

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        if self.every and step % self.every == 0:
            started = time.perf_counter()
            self.last = self.evaluate()
            self.clock.exclude(time.perf_counter() - started)  # samples_per_s is about training


class Logging:
    """A record of the step every `every` steps and at the last one: the run log, then the
    watchdogs' checks on its numbers."""

    def __init__(self, every: int, last_step: int, record: Callable[[torch.Tensor, float, float], dict[str, Any]],
                 write: Callable[[dict[str, Any]], None], check: Callable[[dict[str, Any]], None],
                 clock: StepClock, samples_seen: Callable[[], int]) -> None:
        self.every, self.last_step, self.record, self.write, self.check = every, last_step, record, write, check
        self.clock, self.samples_seen = clock, samples_seen

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        if step % self.every == 0 or step == self.last_step:
            rate, step_time = self.clock.window(step, self.samples_seen())
            record = self.record(loss, rate, step_time)
            self.write(record)
            self.check(record)


class Checkpointing:
    """A checkpoint every `every` steps (0: only the final one, which is not this one's)."""

    def __init__(self, every: int, save: Callable[[], Any]) -> None:
        self.every, self.save = every, save

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        if self.every and step % self.every == 0:
            self.save()


class Preemption:
    """Stops training at the step every rank agrees on once any rank got a preemption signal."""

    def __init__(self, watch: PreemptionWatch, last_step: int, stop: Callable[[], dict[str, Any]]) -> None:
        self.watch, self.last_step, self.stop = watch, last_step, stop

    def after_step(self, step: int, loss: torch.Tensor) -> dict[str, Any] | None:
        if step < self.last_step and self.watch.should_stop(step):
            return self.stop()
        return None
