"""How one micro-batch becomes a loss, by what the task gives (tasks/__init__.py):

- `step_fn(model, batch)`: the task's own step, for batches and forwards of any shape
  (`model(x, hidden)`, dict batches, several outputs). It returns the loss, or a mapping
  with `"loss"` and other scalars to log.
- `loss_fn(output, target)`: the batch is `(input, target)` and the loss is
  `loss_fn(model(input), target)`.
- neither: the model computes its own loss, as Hugging Face models do: a mapping batch is
  passed as keywords (`model(**batch)`), a tuple or list as positional arguments, anything
  else as the one argument, and the output's `loss` (attribute or key) is the loss.

Each runs inside the Trainer's autocast region, with the wrapped model (DDP on several
ranks) and the batch already on the device; the Trainer owns scaling, accumulation,
clipping, the agreed skip and checkpoints either way. Nothing here reads the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddp_amp.errors import UsageError
from ddp_amp.tasks import Task
from ddp_amp.torch_api import DTensor

Extras = dict[str, torch.Tensor]


def whole(value: torch.Tensor) -> torch.Tensor:
    """A loss or metric computed on a split model's logits (a DTensor: tensor parallel's loss
    parallel) as the plain tensor every rank then holds; any other tensor as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _own_loss(output: Any) -> Any:
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None)


def _call_with(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        return model(*batch)
    return model(batch)


class BatchLoss:
    """`batch_loss(model, batch) -> (loss, extras)`: the task's loss of one micro-batch.

    `extras` holds the other scalars a `step_fn` returned (None without them). With
    `compile_loss`, a `loss_fn` runs compiled (see Trainer: a large-vocabulary
    cross-entropy then runs fused).
    """

    def __init__(self, task: Task, compile_loss: bool = False) -> None:
        self.task_name = task.name or "the task"
        if task.step_fn is not None:
            self._loss_of: Callable[[nn.Module, Any], tuple[torch.Tensor, Extras | None]] = self._step_fn_loss
            self._step_fn = task.step_fn
        elif task.loss_fn is not None:
            self._loss_of = self._loss_fn_loss
            self._loss_fn = torch.compile(task.loss_fn) if compile_loss else task.loss_fn
        else:
            self._loss_of = self._model_loss

    @property
    def hands_model_to_task(self) -> bool:
        """Whether the task's own code gets the model (a step_fn)."""
        return self._loss_of == self._step_fn_loss

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Extras | None]:
        return self._loss_of(model, batch)

    def _loss_fn_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Extras | None]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise UsageError("the task's batches", type(batch).__name__, "(input, target) pairs for Task.loss_fn",
                             "give the Task a step_fn(model, batch) for batches of another shape")
        inputs, target = batch
        return self._loss_fn(model(inputs), target), None

    def _step_fn_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Extras | None]:
        result = self._step_fn(model, batch)
        if isinstance(result, torch.Tensor):
            return result, None
        if isinstance(result, Mapping) and isinstance(result.get("loss"), torch.Tensor):
            extras = {name: value.detach() for name, value in result.items()
                      if name != "loss" and isinstance(value, torch.Tensor) and value.numel() == 1}
            return result["loss"], extras or None
        raise UsageError("Task.step_fn's result", type(result).__name__,
                         "a loss tensor, or a mapping with a 'loss' tensor and other scalars to log",
                         "return loss, or {'loss': loss, 'accuracy': accuracy}")

    def _model_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Extras | None]:
        loss = _own_loss(_call_with(model, batch))
        if not isinstance(loss, torch.Tensor):
            raise UsageError(f"{self.task_name}'s model output", "without a loss",
                             "a Task.loss_fn, a Task.step_fn, or a model whose output has a .loss",
                             "give the Task loss_fn(output, target) or step_fn(model, batch) -> loss")
        return loss, None
