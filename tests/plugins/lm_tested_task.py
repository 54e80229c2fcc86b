"""The built-in `lm` task whose held-out text is also its test split: a test pass with the best
checkpoint's weights must score exactly what that checkpoint's evaluation scored."""

from __future__ import annotations

from ddp_amp import Task, TrainConfig
from ddp_amp.tasks.lm import make_task as make_lm


def make_task(config: TrainConfig) -> Task:
    task = make_lm(config)
    task.test_data = task.eval_data
    return task
