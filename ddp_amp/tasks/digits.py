"""`digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

The images ship inside the scikit-learn wheel (`sklearn.datasets.load_digits`), so nothing
is downloaded; scikit-learn is the optional extra `pip install 'ddp_amp[sklearn]'`. A
fixed random split (the same for every seed) holds out 30% of the images; the metric is accuracy.
The model is a small MLP. Task options: hidden (width), held_out (percent of images).
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

DEFAULTS = {"hidden": 128, "held_out": 30}


def load_images() -> tuple[torch.Tensor, torch.Tensor]:
    """(images scaled to [0, 1] as (N, 64) float, labels (N,) long) from scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise UsageError("--task", "digits", "scikit-learn installed (it bundles the digits images)",
                         "pip install 'ddp_amp[sklearn]'") from error
    bunch = load_digits()
    images = torch.as_tensor(bunch.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    return images, torch.as_tensor(bunch.target, dtype=torch.long)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """Correct predictions and count; reduced over batches and ranks, then divided."""
    return {"accuracy": ((output.argmax(dim=-1) == target).sum(), target.numel())}


def read_options(options: dict[str, str]) -> dict[str, int]:
    values = {key: int(value) for key, value in parse_task_options(options, DEFAULTS).items()}
    if values["hidden"] < 1:
        raise UsageError("--task-opt hidden", values["hidden"], "an integer >= 1", "e.g. --task-opt hidden=128")
    if not 1 <= values["held_out"] <= 90:
        raise UsageError("--task-opt held_out", values["held_out"], "a percentage from 1 to 90",
                         "e.g. --task-opt held_out=30")
    return values


def make_task(config: TrainConfig) -> Task:
    from ddp_amp.tasks import Task

    opts = read_options(config.task_options())
    images, labels = load_images()
    # The split comes from its own generator: every rank and every seed hold out the same
    # images, so runs with different seeds are scored on the same test set.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1797))
    cut = len(labels) * opts["held_out"] // 100
    held, kept = order[:cut], order[cut:]
    hidden = opts["hidden"]
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    return Task(
        shard_units=(nn.Linear,),
        model=model,
        train_data=TensorDataset(images[kept], labels[kept]),
        eval_data=TensorDataset(images[held], labels[held]),
        loss_fn=lambda output, target: nn.functional.cross_entropy(output.float(), target),
        metric=accuracy,
        default_lr=1e-3,
        name="digits",
    )
