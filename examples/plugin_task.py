"""An example of your own task: classify points by which of three rings they lie on.

Run it from the repository root (the folder that holds `examples/`):

    python -m ddp_amp.train --task examples.plugin_task:make_task --eval-every 50
    torchrun --standalone --nproc_per_node=2 -m ddp_amp.train \\
        --task examples.plugin_task:make_task --task-opt samples=4096 --eval-every 50

`--task package.module:function` imports `package.module` (from the current directory or
PYTHONPATH) and calls `function(config)` on every rank; it must return a `ddp_amp.Task`.
Everything here is plain PyTorch: the trainer adds DDP, autocast and loss scaling.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp import Task, TrainConfig, UsageError


def make_rings(samples: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Points on three noisy concentric rings (radius 1, 2, 3); the label is the ring."""
    labels = torch.randint(0, 3, (samples,), generator=generator)
    angle = torch.rand(samples, generator=generator) * 2 * math.pi
    radius = labels.float() + 1 + 0.25 * torch.randn(samples, generator=generator)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return points, labels


def accuracy(output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """The metric contract: {name: (sum over this batch, items in this batch)}.

    The trainer adds sums and counts over batches and ranks, then divides: exact whatever
    the batch size or number of ranks.
    """
    return {"accuracy": ((output.argmax(dim=-1) == target).sum(), target.numel())}


def make_task(config: TrainConfig) -> Task:
    """Called once per rank with the run's config; must give every rank the same data."""
    options = config.task_options()  # from --task-opt KEY=VALUE
    unknown = set(options) - {"samples", "hidden"}
    if unknown:
        raise UsageError("--task-opt", sorted(unknown)[0], "samples or hidden", "")
    samples = int(options.get("samples", 2048))
    hidden = int(options.get("hidden", 64))
    # A generator of its own: the same points on every rank whatever the global RNG state.
    points, labels = make_rings(samples, torch.Generator().manual_seed(config.seed + 7))
    cut = samples // 5  # hold out 20% for evaluation
    model = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 3))
    return Task(
        model=model,  # built the same on every rank: the trainer seeds before calling us
        train_data=TensorDataset(points[cut:], labels[cut:]),  # items are (input, target)
        eval_data=TensorDataset(points[:cut], labels[:cut]),
        # The loss runs under autocast; cross-entropy autocasts to fp32 by itself, the
        # .float() makes that explicit.
        loss_fn=lambda output, target: nn.functional.cross_entropy(output.float(), target),
        metric=accuracy,
        make_optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        make_scheduler=lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=config.max_steps),  # stepped once per optimizer step taken
        default_lr=3e-3,  # used unless --lr is given
        name="rings",
    )
