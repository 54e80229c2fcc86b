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

A schedule that changes the LR on every step (cosine, warmup) would read the flags every
step that way. Where the optimizer takes its LR as a device tensor (fused or capturable
kernels), the LR is planned instead: from an exact state the scheduler is stepped ahead
`PLAN_STEPS` times on the host, the LRs after 0, 1, 2, ... taken steps go into a table on
the device, and after each optimizer step a few device ops index it with the number of
steps taken so far (steps minus the scaler's skip count, both on the device). Every step
uses the LR it would get from stepping on taken steps only, and nothing is read until the
plan runs out (settled on a log step past half of it) or a checkpoint. A schedule that
changes other hyperparameters too (OneCycleLR's momentum) is not planned: only the LR is.
The planned LR is float32 (what the fused kernels compute with), on every step alike, so
where the exact states fall does not change a run.
"""

from __future__ import annotations

import copy
import struct
import warnings
from typing import Any

import torch

from ddp_amp.session import AgreedGradScaler


PLAN_STEPS = 1024  # LRs planned ahead: at most one flag read per this many steps


def _takes_device_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group's step kernel reads its LR from a tensor without a host sync."""
    return all(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)


def _same(a: Any, b: Any) -> bool:
    return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)


class TakenStepScheduler:
    """Steps `scheduler` once per taken optimizer step; see the module docstring."""

    _exact_lrs: list[Any]  # the groups' LRs when the scheduler's state was last exact (mark_exact)

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: AgreedGradScaler) -> None:
        self.scheduler, self.scaler = scheduler, scaler
        self.flag_reads = 0  # host syncs spent on skip flags (tests read it)
        self.planned = scaler.is_enabled() and _takes_device_lr(scheduler.optimizer)
        self._lr: torch.Tensor | None = None  # the groups' LRs on the device, while installed
        self._installed = False
        self.mark_exact()

    def _lrs(self) -> list[Any]:
        return [group["lr"] for group in self.scheduler.optimizer.param_groups]

    def _set_lrs(self, lrs: list[Any]) -> None:
        for group, lr in zip(self.scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr

    def mark_exact(self) -> None:
        """The scheduler's state is exact now (after a settle, or after loading a checkpoint)."""
        if self._installed and any(isinstance(lr, torch.Tensor) for lr in self._lrs()):
            self._set_lrs(self._exact_lrs)  # still the plan's views: the optimizer was not reloaded
        self._installed = False
        self._state = copy.deepcopy(self.scheduler.state_dict())
        self._exact_lrs = self._lrs()
        self._skipped_before = self.scaler.skipped_steps().clone()
        self._pending = 0
        if self.planned:
            self._plan()

    def _plan(self) -> None:
        """Step ahead from the exact state, table the LRs, put the scheduler back."""
        groups = self.scheduler.optimizer.param_groups
        hyper = [{key: value for key, value in group.items() if key != "params"} for group in groups]
        rows = [list(self._exact_lrs)]
        for _ in range(PLAN_STEPS):
            self._step_quietly()
            rows.append(self._lrs())
        others_changed = any(not _same(group[key], value) for group, before in zip(groups, hyper)
                             for key, value in before.items() if key != "lr")
        self.scheduler.load_state_dict(self._state)
        for group, before in zip(groups, hyper):
            group.update(before)
        if others_changed or any(isinstance(lr, torch.Tensor) for row in rows for lr in row):
            self.planned = False  # only a float LR can be planned; settle where it changes instead
            return
        device = self.scaler.skipped_steps().device
        self._table = torch.tensor(rows, dtype=torch.float32, device=device)
        self._constant = all(row == rows[0] for row in rows)

    def before_step(self) -> None:
        """Call before each optimizer step: puts the planned LRs in place after an exact state
        (the groups hold exact floats there, which is what a checkpoint saves)."""
        if self.planned and not self._installed:
            self._lr = self._table[0].clone()
            self._set_lrs(list(self._lr.unbind()))  # views: one copy into _lr sets every group's
            self._installed = True

    def before_log(self) -> None:
        """On a log step (which reads the device anyway): settle a plan past its half, so the
        next one starts here and not on a step that reads nothing else."""
        if self.planned and self._pending >= PLAN_STEPS // 2:
            self.settle()

    def logged_lr(self) -> float:
        """The first group's LR for the log (a host read where it is planned): the float32
        value the planned steps use, also on a step where the group holds the exact float."""
        lr = self.scheduler.optimizer.param_groups[0]["lr"]
        if not self.planned:
            return lr
        return float(lr) if isinstance(lr, torch.Tensor) else struct.unpack("f", struct.pack("f", lr))[0]

    def after_step(self) -> None:
        """Call once per optimizer step, after `scaler.update()`."""
        if not self.scaler.is_enabled():  # bf16/fp32 never skip
            self.scheduler.step()
            return
        self._pending += 1
        if self.planned:
            if self._pending >= PLAN_STEPS:
                self.settle()
            elif not self._constant and self._installed and self._lr is not None:  # installing sets _lr
                taken = self._pending - (self.scaler.skipped_steps() - self._skipped_before)
                self._lr.copy_(torch.index_select(self._table, 0, taken.view(1).long())[0])
            return
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
        if self.planned:  # the scheduler was not stepped since the exact state: step it now
            self._set_lrs(self._exact_lrs)
            self._installed = False
            for _ in range(self._pending - skipped):
                self._step_quietly()
        elif skipped:
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
