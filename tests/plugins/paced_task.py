"""A plugin task whose steps take a set wall time, for tests that race a clock (Slurm time limits).

Task option `step_ms` (default 20): every loss call sleeps that long, so a run of N steps
needs about N x step_ms of wall time whatever the machine's speed, and leaves the CPU to
the other processes while it waits.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp import Task, TrainConfig


def make_task(config: TrainConfig) -> Task:
    pause = float(config.task_options().get("step_ms", "20")) / 1000
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(256, 8, generator=generator)
    targets = inputs[:, :2].sin()

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(pause)
        return nn.functional.mse_loss(output.float(), target)

    return Task(model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                train_data=TensorDataset(inputs, targets), loss_fn=loss_fn, default_lr=1e-2, name="paced")
