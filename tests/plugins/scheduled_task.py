"""The built-in `mlp` task with a scheduler at another cadence (`--task-opt on=eval|epoch`).

- `eval`: ReduceLROnPlateau on `eval_mse` (patience 0, factor 0.5): every evaluation that
  does not improve on the best by 10% halves the LR;
- `epoch`: StepLR(step_size=1, gamma=0.5) stepped once per pass over the training data.
"""

from __future__ import annotations

import torch

from ddp_amp import Task, TrainConfig
from ddp_amp.tasks.mlp import make_task as make_mlp


def make_task(config: TrainConfig) -> Task:
    options = config.task_options()
    on = options.pop("on", "eval")
    task = make_mlp(TrainConfig(task="mlp", seed=config.seed, task_opt=tuple(f"{k}={v}" for k, v in options.items())))
    task.make_optimizer = lambda params, lr: torch.optim.SGD(params, lr=lr)
    if on == "eval":
        task.make_scheduler = lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=0.5, patience=0, threshold=0.1)
        task.schedule_on = "eval:eval_mse"
    else:
        task.make_scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        task.schedule_on = "epoch"
    return task
