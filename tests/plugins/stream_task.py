"""A task whose training data is a stream (`IterableDataset`): a linear teacher's examples,
generated item by item from a fixed seed, `--task-opt items=N` per pass."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import IterableDataset

from ddp_amp import Task, TrainConfig

FEATURES = 6


class TeacherStream(IterableDataset):
    """The same `items` (input, target) pairs on every pass, in the same order."""

    def __init__(self, items: int) -> None:
        self.items = items
        self.teacher = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(7))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(11)
        for _ in range(self.items):
            x = torch.randn(FEATURES, generator=generator)
            yield x, x @ self.teacher


def make_task(config: TrainConfig) -> Task:
    items = int(config.task_options().get("items", "200"))
    return Task(model=nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1)),
                train_data=TeacherStream(items), loss_fn=nn.functional.mse_loss, default_lr=0.05)
