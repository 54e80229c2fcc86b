"""`mlp`: the AMP recipe's network (Linear + ReLU stack, MSE) on synthetic teacher data.

The targets come from a fixed random "teacher" network, so the loss has something to
learn and falls visibly. Sizes are task options; the AMP recipe's own sizes are
``--task-opt in_size=4096 --task-opt hidden=4096 --task-opt out_size=4096 --task-opt layers=3``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.errors import UsageError
from ddp_amp.tasks import parse_task_options

if TYPE_CHECKING:
    from ddp_amp.config import TrainConfig
    from ddp_amp.tasks import Task

DEFAULTS = {"in_size": 64, "hidden": 256, "out_size": 16, "layers": 3, "samples": 8192}


def make_model(in_size: int, hidden: int, out_size: int, layers: int) -> nn.Sequential:
    """The recipe's network: (layers - 1) x [Linear, ReLU], then a Linear."""
    parts: list[nn.Module] = []
    width = in_size
    for _ in range(layers - 1):
        parts += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    parts.append(nn.Linear(width, out_size))
    return nn.Sequential(*parts)


def read_sizes(options: dict[str, str]) -> dict[str, int]:
    sizes = parse_task_options(options, DEFAULTS)
    for key, value in sizes.items():
        if value < 1:
            raise UsageError(f"--task-opt {key}", value, "an integer >= 1", f"e.g. --task-opt {key}={DEFAULTS[key]}")
    return {key: int(value) for key, value in sizes.items()}


def make_task(config: TrainConfig) -> Task:
    from ddp_amp.tasks import Task

    sizes = read_sizes(config.task_options())
    # Data and teacher come from their own generator so every rank builds the same dataset
    # whatever the global RNG state is.
    generator = torch.Generator().manual_seed(config.seed + 12345)
    teacher = make_model(sizes["in_size"], 32, sizes["out_size"], 2)
    with torch.no_grad():
        for param in teacher.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
        inputs = torch.randn(sizes["samples"], sizes["in_size"], generator=generator)
        targets = teacher(inputs)
    split = sizes["samples"] // 8
    model = make_model(sizes["in_size"], sizes["hidden"], sizes["out_size"], sizes["layers"])
    return Task(
        shard_units=(nn.Linear,),
        model=model,
        train_data=TensorDataset(inputs[split:], targets[split:]),
        eval_data=TensorDataset(inputs[:split], targets[:split]),
        loss_fn=nn.functional.mse_loss,
        metric=lambda output, target: {
            "mse": (nn.functional.mse_loss(output.float(), target, reduction="sum") / target.shape[-1],
                    target.shape[0])},
        default_lr=1e-3,
        name="mlp",
    )
