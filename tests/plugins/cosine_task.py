"""The mlp task with a per-step cosine LR schedule: the LR changes on every optimizer step.

For the host-read tests: under fp16 a schedule that changes the LR every step must not read
the skip flag every step.
"""

from __future__ import annotations

import torch

from ddp_amp import Task, TrainConfig
from ddp_amp.tasks.mlp import make_task as make_mlp


def make_task(config: TrainConfig) -> Task:
    task = make_mlp(config)
    task.make_scheduler = lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    task.name = "cosine"
    return task
