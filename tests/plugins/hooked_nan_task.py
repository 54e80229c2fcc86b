"""A plugin task whose own post-accumulate-grad hooks write NaN into gradients, for the forensics tests.

    --task tests.plugins.hooked_nan_task:make_task --task-opt bad_rank=1 --task-opt steps=3,7,8 \
        --task-opt build=0.weight --task-opt every_step=2.bias

On rank `bad_rank`, at the backward numbers in `steps` (counted from 1), a hook registered
with `register_post_accumulate_grad_hook` fills a parameter's gradient with NaN in place, as
a user's gradient-editing hook might. The loss and the other gradients stay finite; DDP's
reduction then spreads the NaN to every rank.
`build=NAME`: that parameter's hook is registered once, when the task is built.
`every_step=NAME`: a one-shot hook is registered on that parameter in each call of the loss
function (after the forward, before its backward) and removes itself once it has run: it is
registered anew on every step, so after anything registered before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.hooks import RemovableHandle

from ddp_amp.tasks import Task
from ddp_amp.tasks.mlp import make_model

if TYPE_CHECKING:
    from ddp_amp.config import TrainConfig


def make_task(config: TrainConfig) -> Task:
    options = config.task_options()
    bad = (dist.get_rank() if dist.is_initialized() else 0) == int(options.get("bad_rank", "1"))
    steps = {int(s) for s in options.get("steps", "3,7,8").split(",")}
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(256, 8, generator=generator)
    targets = inputs[:, :2] * 0.5
    model = make_model(8, 16, 2, 2)
    params = dict(model.named_parameters())
    one_shot: list[RemovableHandle] = []

    def nan_writer(once: bool) -> Callable[[torch.Tensor], None]:
        backwards = [0]

        def write_nan(tensor: torch.Tensor) -> None:
            backwards[0] += 1
            if bad and backwards[0] in steps and tensor.grad is not None:
                tensor.grad.fill_(float("nan"))
            if once:
                one_shot.pop().remove()
        return write_nan

    if "build" in options:
        params[options["build"]].register_post_accumulate_grad_hook(nan_writer(once=False))
    every_step = params[options["every_step"]] if "every_step" in options else None
    step_writer = nan_writer(once=True)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if every_step is not None:
            one_shot.append(every_step.register_post_accumulate_grad_hook(step_writer))
        return nn.functional.mse_loss(output.float(), target)

    return Task(model=model, train_data=TensorDataset(inputs, targets), loss_fn=loss_fn,
                default_lr=1e-2, name="hooked_nan")
