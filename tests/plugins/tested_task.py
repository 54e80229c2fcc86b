"""The built-in `mlp` task with a test set: the first 24 held-out items, scored once at the end."""

from __future__ import annotations

from torch.utils.data import Subset

from ddp_amp import Task, TrainConfig
from ddp_amp.tasks.mlp import make_task as make_mlp


def make_task(config: TrainConfig) -> Task:
    task = make_mlp(config)
    task.test_data = Subset(task.eval_data, range(24))
    return task
