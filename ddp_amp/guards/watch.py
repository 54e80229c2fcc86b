"""The run's watchdogs on the training loop's cadence: overflow reports, loss-scale guard, sync guard.

The trainer makes one `RunWatch` and calls it at five points:
- `after_update(step, loss)`: every step, after `scaler.update()` and before `zero_grad`
  (the skipped step's gradients are still there for forensics);
- `before_checkpoint(step, resume_from)`: before every checkpoint, so none holds a
  non-finite state;
- `on_log(record)`: at every logged step;
- `after_resume(step)`: once, right after a checkpoint was loaded;
- `finish(step)`: after the last step (reports overflows not reported yet).

Cost per step: none on the host beyond a list append. Under fp16 the skip counters are
read from the device every `check_every` steps (at most the log cadence, and often enough
to stop a skip streak near its limit; each read is a host sync on a GPU). When a check
sees new skips the overflow probe arms itself for a while (forensics.py); the overflow
report (an all-gather) runs only when skips happened, at a falling rate: the 1st, 2nd,
4th, 8th ... overflow event, and at least once per 1000 steps while they continue.
bf16/fp32 runs check that the logged loss is finite, and the finite guard keeps each
step's loss on the device until a checkpoint looks at them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddp_amp.amp import AgreedGradScaler, Precision
from ddp_amp.errors import TrainingHalted
from ddp_amp.guards.finite import FiniteStateGuard
from ddp_amp.guards.forensics import ARMED_FOR, OverflowProbe, describe
from ddp_amp.guards.options import WatchOptions
from ddp_amp.guards.loss_scale import LossScaleGuard, check_loss_finite
from ddp_amp.guards.rank_sync import check_rank_sync
from ddp_amp.metrics import RunLog

REPORT_AT_LEAST_EVERY = 1000  # steps between overflow reports while overflows continue


class RunWatch:
    """Loss-scale guard, overflow forensics and the rank-consistency guard for one rank."""

    def __init__(self, options: WatchOptions, named_params: list[tuple[str, nn.Parameter]],
                 scaler: AgreedGradScaler, run_log: RunLog, rank: int, precision: Precision,
                 distributed: bool = False) -> None:
        self.scaler, self.run_log, self.precision = scaler, run_log, precision
        self.named_params = named_params
        self.options = options.loss_scale
        self.guard = LossScaleGuard(self.options)
        self.sync_every = options.check_sync_every
        device = next((p.device for _, p in named_params), None)
        self.finite = FiniteStateGuard(device or torch.device("cpu"), track_losses=not scaler.is_enabled())
        self.distributed = distributed
        self.probe: OverflowProbe | None = None
        if scaler.is_enabled() and device is not None:
            self.probe = OverflowProbe(named_params, rank)
        limit = self.options.max_consecutive_skips or options.log_every
        # Each read of the device's counters is a host sync on a GPU: read at most every log
        # step, and often enough to stop a skip streak near its limit.
        self.check_every = max(1, min(options.log_every, limit // 2))
        self._last_skips_seen = 0  # the check step that last saw new skips
        self._seen_skips = 0
        self._events = 0
        self._pending = 0
        self._last_report = 0

    def after_update(self, step: int, loss: torch.Tensor) -> None:
        """Per-step checks; `step` counts this step (collective on check steps, on all ranks)."""
        self.finite.record(step, loss)
        if self.probe is not None and step % self.check_every == 0:
            total = int(self.scaler.skipped_steps().item())
            new, self._seen_skips = total - self._seen_skips, total
            if new:
                self._overflowed(step, new)
            elif self.probe.armed and step - self._last_skips_seen >= ARMED_FOR:
                self.probe.disarm()  # the skips have stopped: back to no hooks at all
            try:
                self.guard.check(self.scaler, step)
            except TrainingHalted as error:
                self._report(step)  # what the last overflows looked like, before stopping
                self._halt(step, error)
        if self.sync_every and step % self.sync_every == 0:
            self.check_sync(step)

    def on_log(self, record: dict[str, Any]) -> None:
        """Checks on a logged step's numbers (the loss there is already the mean over ranks)."""
        # Under fp16 a non-finite loss is an overflow the scaler skips; the guard handles it.
        if not self.precision.uses_loss_scaling:
            try:
                check_loss_finite(record["loss"], record["step"], self.precision)
            except TrainingHalted as error:
                self._halt(record["step"], error)

    def before_checkpoint(self, step: int, resume_from: str) -> None:
        """Stop on every rank, writing nothing, if the state to be saved is not finite (collective)."""
        try:
            self.finite.check([p for _, p in self.named_params], step, resume_from)
        except TrainingHalted as error:
            self._halt(step, error)

    def finish(self, step: int) -> None:
        """At the end of training: report overflows not yet reported (collective)."""
        self._report(step)
        if self.probe is not None:
            self.probe.disarm()

    def after_resume(self, step: int) -> None:
        """Run right after loading a checkpoint, on every rank (collective)."""
        self.finite.restart()
        self._seen_skips = int(self.scaler.skipped_steps().item()) if self.scaler.is_enabled() else 0
        self._last_report = step
        self.check_sync(step, when="after resume")

    def check_sync(self, step: int, when: str = "") -> None:
        """The rank-consistency guard now (collective)."""
        try:
            check_rank_sync(self.named_params, self.scaler, step, when)
        except TrainingHalted as error:
            self._halt(step, error)

    def _overflowed(self, step: int, skipped: int) -> None:
        self._events += 1
        self._pending += skipped
        self._last_skips_seen = step
        if self.probe is not None:
            local = not self.distributed or self.probe.sharded  # no hook would see more (forensics.py)
            if local and self.scaler.last_step_skipped().item():
                self.probe.scan_grads()  # the gradients of this step, this rank's of them
            if not self.probe.sharded:
                self.probe.arm()  # the local gradients of the next steps get checked
        power_of_two = self._events & (self._events - 1) == 0
        if power_of_two or step - self._last_report >= REPORT_AT_LEAST_EVERY:
            self._report(step)

    def _report(self, step: int) -> None:
        if self.probe is None or not self._pending:
            return
        record = self.probe.report(step, self._pending)
        record["loss_scale"] = self.scaler.get_scale()
        self._pending, self._last_report = 0, step
        self.run_log.event(record, f"overflow: {describe(record)}; loss scale now {record['loss_scale']:.4g}")

    def _halt(self, step: int, error: TrainingHalted) -> None:
        self.run_log.event({"event": "halted", "step": step, "reason": str(error)},
                          f"stopping at step {step}: a safety check failed (the error follows)")
        raise error
