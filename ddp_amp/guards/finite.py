"""Never commit a broken state: a checkpoint is written only from finite weights.

Under bf16 or fp32 nothing skips a step whose loss is NaN or inf: its gradients reach the
weights, and every rank's weights after it are non-finite (DDP sums the bad gradients
into everyone's). The logged loss shows it only at the next log step, so without a check
every checkpoint in between would commit the broken weights and retention would delete the
finite ones. Here:
- every step's loss is looked at: on a GPU kept by reference (no op, no launch) and every
  `FOLD_EVERY` steps and before a check folded on the device into the first non-finite
  step (a few vectorized ops, no host sync); on a CPU its value is read at once, which is
  no sync there and the cheapest way to look at it: about 2 us a step, where a copy into a
  buffer cost about 4 and kept 0-d tensors cost the CPU more (a thousand of them scattered
  through the heap stop the C allocator from giving freed memory back, and even a few dozen
  slow the step down; docs/facts.md, "Host time on the hot path"). Either way the stop can
  name the step where it went wrong;
- before every checkpoint, each rank checks its weights, its shards of sharded ones (one
  pass over them, read once), and the ranks gather what they found (collective); if any
  rank's weights or losses are non-finite, nothing is written and every rank stops with
  the step and the newest finite checkpoint to resume from.
Under fp16 the scaler skips non-finite steps, so only the weights are checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ddp_amp.distributed import all_gather_objects, local_part
from ddp_amp.errors import TrainingHalted


FOLD_EVERY = 1024  # losses kept before they are folded: bounds the list, amortizes the ops


class FiniteStateGuard:
    """The first non-finite step loss (on the device) and the pre-checkpoint weight check."""

    def __init__(self, device: torch.device, track_losses: bool) -> None:
        self.track_losses = track_losses
        self.read_at_once = device.type == "cpu"  # a CPU's value: reading it waits for nothing
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)  # a GPU's, folded
        self._first_bad_read = -1  # a CPU's, read
        self._losses: list[torch.Tensor] = []  # on a GPU: the kept losses themselves
        self._first_step = 0

    def record(self, step: int, loss: torch.Tensor) -> None:
        """Look at `step`'s detached loss (on a GPU: keep it for later, no host sync). Steps
        come one by one; call `restart()` where they jump (a checkpoint loaded in the same
        process)."""
        if not self.track_losses:
            return
        if self.read_at_once:
            if self._first_bad_read < 0 and not math.isfinite(loss.item()):
                self._first_bad_read = step
            return
        if not self._losses:
            self._first_step = step
        self._losses.append(loss)
        if len(self._losses) >= FOLD_EVERY:
            self._fold()

    def restart(self) -> None:
        """Fold what was kept: the next recorded step need not follow the last one."""
        self._fold()

    @property
    def first_bad_step(self) -> int:
        """The first step whose loss was non-finite, or -1 (a host read on a GPU)."""
        self._fold()
        return self._first_bad_read if self.read_at_once else int(self._first_bad.item())

    def _fold(self) -> None:
        """The first non-finite step among the kept losses, if none was found before (device ops)."""
        if not self._losses:
            return
        bad = torch.isfinite(torch.stack(self._losses).float().reshape(-1)).logical_not()
        first = self._first_step + torch.argmax(bad.to(torch.int8))  # argmax: the first maximum
        fresh = torch.where(bad.any(), first.to(torch.int64), -1)
        self._first_bad = torch.where(self._first_bad >= 0, self._first_bad, fresh.to(self._first_bad.device))
        self._losses = []

    @torch.no_grad()
    def check(self, params: Sequence[nn.Parameter], step: int, resume_from: str) -> None:
        """Raise TrainingHalted on every rank if any rank's weights or losses went non-finite.

        Collective: one all-gather. `resume_from` names the newest finite checkpoint.
        """
        # Each rank reads its own part: all of a replicated parameter, its shard of a sharded one.
        weights_bad = bool(params) and not bool(torch.stack([torch.isfinite(local_part(p)).all()
                                                             for p in params]).all())
        found = all_gather_objects((self.first_bad_step, weights_bad))
        bad_steps = sorted(first for first, _ in found if first >= 0)
        bad_ranks = [rank for rank, (_, bad) in enumerate(found) if bad]
        if not bad_steps and not bad_ranks:
            return
        where = f"the loss first went non-finite at step {bad_steps[0]}" if bad_steps else \
            f"the weights of rank(s) {bad_ranks} are non-finite"
        raise TrainingHalted(
            f"not checkpointing step {step}: {where}, so the model is no longer finite. Nothing was "
            f"written from this state; {resume_from}. Try a lower --lr or --clip-grad-norm 1.0.")
