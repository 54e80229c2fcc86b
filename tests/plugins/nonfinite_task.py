"""A plugin task that goes non-finite on purpose, for the loss-scale guard and forensics tests.

    --task tests.plugins.nonfinite_task:make_task --task-opt poison=0.weight --task-opt bad_rank=1 \
        --task-opt from_step=3

`poison=NAME`: from backward number `from_step` on, the gradient of parameter NAME becomes
inf on rank `bad_rank` only (a tensor hook, so it runs before DDP reduces the bucket): the
loss stays finite, the local gradients of one rank do not.
`poison=loss`: from call `from_step` on, the loss is NaN on every rank.
`poison=rank_loss`: from call `from_step` on, the loss is NaN on rank `bad_rank` only (its
NaN gradients then reach every rank's weights through DDP's reduction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task
from ddp_amp.tasks.mlp import make_model

if TYPE_CHECKING:
    from ddp_amp.config import TrainConfig


class _Countdown:
    """Counts calls; true from call number `start` on."""

    def __init__(self, start: int) -> None:
        self.start, self.calls = start, 0

    def tick(self) -> bool:
        self.calls += 1
        return self.calls >= self.start


def make_task(config: TrainConfig) -> Task:
    options = config.task_options()
    poison = options.get("poison", "loss")
    bad_rank = int(options.get("bad_rank", "0"))
    countdown = _Countdown(int(options.get("from_step", "3")))
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(512, 8, generator=generator)
    targets = inputs[:, :2] * 0.5
    model = make_model(8, 16, 2, 2)
    rank = dist.get_rank() if dist.is_initialized() else 0

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(output.float(), target)
        if poison == "loss" and countdown.tick():
            return loss * float("nan")
        if poison == "rank_loss" and countdown.tick() and rank == bad_rank:
            return loss * float("nan")
        return loss

    if poison not in ("loss", "rank_loss"):
        param = dict(model.named_parameters())[poison]

        def poison_grad(grad: torch.Tensor) -> Any:
            if countdown.tick() and rank == bad_rank:
                return grad * float("inf")
            return grad

        param.register_hook(poison_grad)
    return Task(model=model, train_data=TensorDataset(inputs, targets), loss_fn=loss_fn,
                default_lr=1e-2, name="nonfinite")
