"""A task with two optimizers (SGD for the body, Adam for the head), and an inf planted in
the head's gradients on rank 1 at step `--task-opt inf_at=N` (0: never): one skip decision
must then skip *both* optimizers on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp import Task, TrainConfig


class Steps:
    """Counts micro-steps (a Task.state, so a resume counts on from the checkpoint)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


def make_task(config: TrainConfig) -> Task:
    inf_at = int(config.task_options().get("inf_at", "0"))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=generator)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    steps = Steps()

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, target = batch
        steps.count += 1
        loss = nn.functional.mse_loss(model(inputs).float(), target)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if steps.count == inf_at and rank == 1:  # only the head's gradient, only here
            loss = loss + net[2].weight.sum() * float("inf")
        return loss

    return Task(model=net, train_data=TensorDataset(x, x[:, :1] * 2), step_fn=step, state=steps,
                make_optimizer=lambda params, lr: [torch.optim.SGD(net[0].parameters(), lr=lr),
                                                   torch.optim.Adam(net[2].parameters(), lr=lr / 10)],
                default_lr=0.05)
