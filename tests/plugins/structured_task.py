"""A plugin task whose inputs are a namedtuple or a dataclass (`--task-opt batch=namedtuple|dataclass`).

Its items are `(inputs, target)` with `inputs` holding two tensors the model reads by name,
so the batch must reach the model field by field, on the device.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_amp import Task, TrainConfig

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Features:
    left: torch.Tensor
    right: torch.Tensor


class _Items(Dataset):
    def __init__(self, kind: type, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.kind, self.left, self.right = kind, torch.randn(count, 4, generator=generator), torch.randn(count, 4,
                                                                                                        generator=generator)

    def __len__(self) -> int:
        return len(self.left)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        target = (self.left[index] - self.right[index]).sum(0, keepdim=True)
        return self.kind(self.left[index], self.right[index]), target


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, inputs: Any) -> torch.Tensor:
        return self.left(inputs.left) + self.right(inputs.right)


def make_task(config: TrainConfig) -> Task:
    kind = {"namedtuple": Pair, "dataclass": Features}[config.task_options().get("batch", "namedtuple")]
    return Task(model=_TwoInputs(), train_data=_Items(kind, 128), loss_fn=nn.functional.mse_loss,
                eval_data=_Items(kind, 32), metric=lambda out, target: {"mse": (
                    nn.functional.mse_loss(out.float(), target, reduction="sum"), target.numel())},
                name="structured")
