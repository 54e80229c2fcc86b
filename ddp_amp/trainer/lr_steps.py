"""Advance the LR scheduler on taken steps only, without a host sync on every fp16 step.

Under fp16 the scaler may skip a step (inf/NaN gradients); the LR plan must not advance
then, or a few early skips shift every later decay. Whether the step was skipped is a flag
on the device: reading it every step stalls the host on a GPU, which then cannot queue the
next step's kernels while this one runs.

Most scheduler steps do not change the LR (StepLR per epoch changes it once in hundreds
of steps). So `TakenStepScheduler` steps the scheduler at once, as if the step was taken,
and reads the flags only when that step would change the LR, or when the scheduler's state
must be exact (a checkpoint). If steps were skipped since the last exact state, it rewinds
to that state and replays one scheduler step per taken step. The LR that each optimizer
step uses is therefore the one it would get from stepping on taken steps only: the LR
only changes at a step where the flags were read. Between those steps the scheduler's own
counter may include skipped steps; `settle()` makes it exact (the Trainer calls it before
every checkpoint, and so at the end of `fit()`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from ddp_amp.amp import AgreedGradScaler


class TakenStepScheduler:
    """Steps `scheduler` once per taken optimizer step; see the module docstring."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: AgreedGradScaler) -> None:
        self.scheduler, self.scaler = scheduler, scaler
        self.flag_reads = 0  # host syncs spent on skip flags (tests read it)
        self.mark_exact()

    def _lrs(self) -> list[Any]:
        return [group["lr"] for group in self.scheduler.optimizer.param_groups]

    def mark_exact(self) -> None:
        """The scheduler's state is exact now (after a settle, or after loading a checkpoint)."""
        self._state = copy.deepcopy(self.scheduler.state_dict())
        self._exact_lrs = self._lrs()
        self._skipped_before = self.scaler.skipped_steps().clone()
        self._pending = 0

    def after_step(self) -> None:
        """Call once per optimizer step, after `scaler.update()`."""
        if not self.scaler.is_enabled():  # bf16/fp32 never skip
            self.scheduler.step()
            return
        self._pending += 1
        before = self._lrs()
        self._step_quietly()
        after = self._lrs()
        # A tensor LR cannot be compared without a sync; settling every step is then exact.
        if any(isinstance(lr, torch.Tensor) for lr in after) or after != before:
            self.settle()

    def settle(self) -> None:
        """Make the scheduler's state exact: read the skip flags once, replay if any skipped."""
        if not self._pending:
            return
        self.flag_reads += 1
        skipped = int((self.scaler.skipped_steps() - self._skipped_before).item())
        if skipped:
            taken = self._pending - skipped
            self.scheduler.load_state_dict(self._state)
            for group, lr in zip(self.scheduler.optimizer.param_groups, self._exact_lrs):
                group["lr"] = lr
            for _ in range(taken):
                self._step_quietly()
        self.mark_exact()

    def _step_quietly(self) -> None:
        # torch warns about the call order when a scheduler's first step comes before any
        # optimizer step, which is what a skipped first step looks like, and is intended here.
        # Only that first step is quietened: catch_warnings resets every module's
        # once-only warning registry, so doing it every step would repeat users' warnings.
        if getattr(self.scheduler, "_step_count", 1) != 1:
            self.scheduler.step()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
            self.scheduler.step()
