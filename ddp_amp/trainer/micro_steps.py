"""One optimizer step's micro-batches: each drawn, run forward to its loss under autocast, weighed, and
backpropagated, so that the gradients accumulated are the step's.

A step is `grad_accum` micro-batches; each but the last runs inside `no_sync()`, so DDP (or FSDP)
reduces gradients once per step, averaging them over the ranks. How a micro-batch's loss is weighed:

- A loss that is a mean over its micro-batch (a task's `loss_fn`, `step_fn` or the model's own
  loss): divided by `grad_accum`. The step's loss is the mean of the micro-batches' means, which is
  the mean over the step's items where every micro-batch holds as many (images, text windows whose
  every token is a target).
- A loss that is a sum over items the task counts (`Task.count_loss_items`: the target tokens of a
  language model's batch, which masks make uneven): the step's micro-batches are drawn first, their
  items counted and the counts summed over every rank (one all-reduce of a scalar per step), and each
  micro-batch's sum is weighed by world size / that total. The step's loss, and its gradient, is then
  the sum over every item of every micro-batch and rank divided by the number of items, whatever the
  split of the same global batch into ranks and micro-batches (as Hugging Face's Trainer does with
  `num_items_in_batch`). A mean per micro-batch would weigh a token of a micro-batch with few
  targets more than a token of a full one. World size, not the data-parallel degree: ranks that
  hold the same batch (a tensor-parallel group) count its items once each and are averaged over too,
  so the two cancel; ranks that split its sequences (a context-parallel group) count each its part,
  and their gradients are averaged over them as over data-parallel ranks.

Nothing here reads the device: the counts, the weight and the losses stay there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ddp_amp.errors import UsageError
from ddp_amp.session import AutocastModule, Session
from ddp_amp.trainer.batch_loss import BatchLoss, whole

_NOTHING = nullcontext()  # reusable: nullcontext keeps no state
# What the Trainer's log record writes itself: a step_fn's extra scalars may not take these names.
RECORD_FIELDS = frozenset({"step", "epoch", "loss", "lr", "loss_scale", "skipped_total", "samples_per_s",
                           "step_time", "peak_mem_mb", "tokens_per_s", "tflops", "mfu", "mem_mb", "compiled_graphs"})


def _called_in_step(model: nn.Module, batch_loss: BatchLoss) -> nn.Module:
    """The module the step calls inside its own autocast region: in one process (no DDP) the
    wrapper's inner module, since the wrapper would only find its autocast already entered
    (a module call and a state check saved, about 4 us a step on a CPU); the wrapper itself
    where DDP runs around it, or where a task's step_fn gets the model (its code may call it
    from other threads)."""
    if isinstance(model, AutocastModule) and not model.cast_outputs_to_fp32 and not batch_loss.hands_model_to_task:
        return model.unwrap()
    return model


class MicroSteps:
    """The forward and backward of each micro-batch of one optimizer step of `model`."""

    def __init__(self, session: Session, model: nn.Module, batch_loss: BatchLoss, grad_accum: int,
                 count_items: Callable[[Any], Any] | None = None) -> None:
        self.session, self.model, self.batch_loss, self.grad_accum = session, model, batch_loss, grad_accum
        self._precision = session.precision  # entered every micro-step: read once here
        self._step_model = _called_in_step(model, batch_loss)
        self._count_items = count_items
        self._splits, self._split_loss = session.ctx.tp_size > 1, session.loss_parallel
        # Under context parallel each batch is cut to this rank's part of its sequences as it is
        # drawn: counted and run on that part (the counts of a cp group's ranks add up to the window's).
        self._cut = session.split_sequences if session.ctx.cp_size > 1 else None
        self.extras: dict[str, torch.Tensor] = {}  # a step_fn's other scalars, last step, on the device

    def run(self, stream: Iterator[Any]) -> torch.Tensor:
        """Forward and scaled backward of the next `grad_accum` micro-batches of `stream`; the
        step's loss, detached (collective through a DDP or sharded model, and where items are
        counted)."""
        accum = self.grad_accum
        if self._cut is not None:
            stream = map(self._cut, stream)
        if accum == 1 and self._count_items is None:  # the common step: one micro-batch, its own mean
            return self._micro_step(next(stream), None, first=True)
        batches: Iterator[Any] = stream
        weight: torch.Tensor | None = None  # each loss times this, where items are counted; else over accum
        if self._count_items is not None:
            drawn = [next(stream) for _ in range(accum)]
            batches, weight = iter(drawn), self._weight(self._count_items, drawn)
        total: torch.Tensor | None = None
        for micro in range(accum):
            with self.session.no_sync(self.model) if micro < accum - 1 else _NOTHING:
                loss = self._micro_step(next(batches), weight, first=micro == 0)
            total = loss if total is None else total + loss
        return total  # type: ignore[return-value]  # grad_accum >= 1: the loop ran, total is set

    def _weight(self, count_items: Callable[[Any], Any], batches: list[Any]) -> torch.Tensor:
        """World size over the items of `batches` summed over every rank (collective)."""
        device = self.session.device
        counts = [torch.as_tensor(count_items(batch), device=device) for batch in batches]
        total = self.session.all_reduce(torch.stack(counts).sum().to(torch.int64))
        return self.session.world_size / total.clamp(min=1).to(torch.float32)

    def _micro_step(self, batch: Any, weight: torch.Tensor | None, first: bool) -> torch.Tensor:
        """Forward, loss and the scaled backward of one micro-batch; its weighed loss, detached."""
        # A split model's logits come split over the vocabulary: its loss and that loss's
        # backward run on the parts, inside loss parallel (nothing elsewhere).
        with self._split_loss() if self._splits else _NOTHING:
            # Forward and loss in one autocast region, as in the recipe; the wrapper inside DDP
            # sees it is already in effect and does not enter it again.
            with self._precision.autocast():
                loss, extras = self.batch_loss(self._step_model, batch)
            loss = whole(loss)
            if weight is not None:
                loss = loss * weight
            elif self.grad_accum > 1:
                loss = loss / self.grad_accum
            self.session.backward(loss)
        if extras:
            self._add_extras(extras, first=first)
        return loss.detach()

    def _add_extras(self, extras: dict[str, torch.Tensor], first: bool) -> None:
        """Keep a step_fn's scalars as the step's mean over its micro-batches (device ops only)."""
        accum = self.grad_accum
        for name, value in extras.items():
            share = value.float() / accum if accum > 1 else value.float()
            if name in self.extras and not first:
                self.extras[name] = self.extras[name] + share
                continue
            if name not in self.extras and name in RECORD_FIELDS:
                raise UsageError("Task.step_fn's scalar", name, "a name the log does not use already",
                                 "rename it, e.g. 'train_" + name + "'")
            self.extras[name] = share
