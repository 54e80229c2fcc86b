"""Plugin tasks whose batches are not `(input, target)`: `--task-opt kind=...` picks one.

- `dict_step`: dict items `{"features", "labels"}`, a `step_fn` that returns the loss and
  an accuracy to log, and an `eval_fn` that scores held-out dict batches;
- `two_inputs`: a forward `model(x, scale)` with two inputs, through a `step_fn`;
- `own_loss`: a model that computes its own loss from keyword inputs and returns an output
  with `.loss`, as Hugging Face models do; no loss_fn, no step_fn;
- `bad_result`: a `step_fn` that returns a string (a one-line error at the first step);
- `dict_loss_fn`: dict items with a plain `loss_fn` (a one-line error with a hint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_amp import Task, TrainConfig

FEATURES, CLASSES = 8, 3


class _DictItems(Dataset):
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(count, FEATURES, generator=generator)
        self.labels = (self.features[:, :CLASSES].argmax(1))

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[index], "labels": self.labels[index]}


def _dict_eval(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    logits = model(batch["features"])
    return {"accuracy": ((logits.argmax(1) == batch["labels"]).sum(), len(batch["labels"]))}


def _dict_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    logits = model(batch["features"])
    accuracy = (logits.argmax(1) == batch["labels"]).float().mean()
    return {"loss": nn.functional.cross_entropy(logits.float(), batch["labels"]), "train_accuracy": accuracy}


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * scale


class _PairItems(Dataset):
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(count, FEATURES, generator=generator)
        self.scale = torch.rand(count, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[index], self.scale[index], self.x[index, :1] * self.scale[index]


def _two_input_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, scale, target = batch
    return nn.functional.mse_loss(model(x, scale).float(), target)


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class _OwnLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, CLASSES)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.linear(features)
        return Output(loss=nn.functional.cross_entropy(logits.float(), labels), logits=logits)


def make_task(config: TrainConfig) -> Task:
    kind = config.task_options().get("kind", "dict_step")
    classifier = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))
    tasks: dict[str, Any] = {
        "dict_step": lambda: Task(model=classifier, train_data=_DictItems(256), step_fn=_dict_step,
                                  eval_data=_DictItems(48), eval_fn=_dict_eval),
        "two_inputs": lambda: Task(model=_Scaled(), train_data=_PairItems(256), step_fn=_two_input_step),
        "own_loss": lambda: Task(model=_OwnLoss(), train_data=_DictItems(256)),
        "bad_result": lambda: Task(model=classifier, train_data=_DictItems(256), step_fn=lambda m, b: "loss"),
        "dict_loss_fn": lambda: Task(model=classifier, train_data=_DictItems(256),
                                     loss_fn=nn.functional.cross_entropy),
    }
    return tasks[kind]()
