"""The `lm` task with its model passed whole (`model=`) instead of `build_model=`: what a
task that builds its model itself gets, to compare a sharded build against."""

from __future__ import annotations

from ddp_amp import Task, TrainConfig
from ddp_amp.tasks.lm import make_task as make_lm_task


def make_task(config: TrainConfig) -> Task:
    task = make_lm_task(config)
    assert task.build_model is not None
    # Built here, where the trainer has seeded torch with --seed: the model build_model makes.
    task.model, task.build_model = task.build_model(), None
    return task
