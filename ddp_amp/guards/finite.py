"""Never commit a broken state: a checkpoint is written only from finite weights.

Under bf16 or fp32 nothing skips a step whose loss is NaN or inf: its gradients reach the
weights, and every rank's weights after it are non-finite (DDP sums the bad gradients
into everyone's). The logged loss shows it only at the next log step, so without a check
every checkpoint in between would commit the broken weights and retention would delete the
finite ones. Here:
- every step's loss is kept: on a GPU by reference (no op, no launch); on a CPU copied
  into its slot of a buffer made once (one op), since kept 0-d tensors cost the CPU more:
  a thousand of them scattered through the heap stop the C allocator from giving freed
  memory back, and even a few dozen slow the step down by more than the copy costs
  (docs/facts.md, "Host time on the hot path"); every `FOLD_EVERY` steps and before a
  check they are
  folded on the device into the first non-finite step (a few vectorized ops, no host
  sync), so the stop can name the step where it went wrong;
- before every checkpoint, each rank checks its weights, its shards of sharded ones (one
  pass over them, read once), and the ranks gather what they found (collective); if any
  rank's weights or losses are non-finite, nothing is written and every rank stops with
  the step and the newest finite checkpoint to resume from.
Under fp16 the scaler skips non-finite steps, so only the weights are checked.
"""

from __future__ import annotations

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
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        self._losses: list[torch.Tensor] = []  # on a GPU: the kept losses themselves
        # On a CPU: a buffer of FOLD_EVERY losses, and a view of each of its elements, made once.
        self._copies = torch.empty(FOLD_EVERY) if device.type == "cpu" and track_losses else None
        self._slots = self._copies.unbind() if self._copies is not None else ()
        self._kept = 0
        self._first_step = 0

    def record(self, step: int, loss: torch.Tensor) -> None:
        """Keep `step`'s detached loss to check later (no host sync). Steps come one by one;
        call `restart()` where they jump (a checkpoint loaded in the same process)."""
        if self.track_losses:
            if not self._kept:
                self._first_step = step
            if self._slots:
                self._slots[self._kept].copy_(loss.reshape(()) if loss.dim() else loss)
            else:
                self._losses.append(loss)
            self._kept += 1
            if self._kept >= FOLD_EVERY:
                self._fold()

    def restart(self) -> None:
        """Fold what was kept: the next recorded step need not follow the last one."""
        self._fold()

    def _fold(self) -> None:
        """The first non-finite step among the kept losses, if none was found before (device ops)."""
        if not self._kept:
            return
        kept = self._copies[:self._kept] if self._copies is not None else torch.stack(self._losses).float()
        bad = torch.isfinite(kept.reshape(-1)).logical_not()
        first = self._first_step + torch.argmax(bad.to(torch.int8))  # argmax: the first maximum
        fresh = torch.where(bad.any(), first.to(torch.int64), -1)
        self._first_bad = torch.where(self._first_bad >= 0, self._first_bad, fresh.to(self._first_bad.device))
        self._losses, self._kept = [], 0

    @torch.no_grad()
    def check(self, params: Sequence[nn.Parameter], step: int, resume_from: str) -> None:
        """Raise TrainingHalted on every rank if any rank's weights or losses went non-finite.

        Collective: one all-gather. `resume_from` names the newest finite checkpoint.
        """
        self._fold()
        # Each rank reads its own part: all of a replicated parameter, its shard of a sharded one.
        weights_bad = bool(params) and not bool(torch.stack([torch.isfinite(local_part(p)).all() for p in params]).all())
        found = all_gather_objects((int(self._first_bad.item()), weights_bad))
        bad_steps = sorted(first for first, _ in found if first >= 0)  # type: ignore[misc]
        bad_ranks = [rank for rank, (_, bad) in enumerate(found) if bad]  # type: ignore[misc]
        if not bad_steps and not bad_ranks:
            return
        where = f"the loss first went non-finite at step {bad_steps[0]}" if bad_steps else \
            f"the weights of rank(s) {bad_ranks} are non-finite"
        raise TrainingHalted(
            f"not checkpointing step {step}: {where}, so the model is no longer finite. Nothing was "
            f"written from this state; {resume_from}. Try a lower --lr or --clip-grad-norm 1.0.")
