"""The run's optimizer: the task's own, or AdamW / SGD with the fastest kernels available."""

from __future__ import annotations

import torch
from torch import nn

from ddp_amp.tasks import Task


def optimizer_kwargs(impl: str, device: torch.device) -> list[dict[str, bool]]:
    """Keyword choices to try in order for `--optimizer-impl` (fused may be unavailable)."""
    if impl == "fused":
        return [{"fused": True}]
    if impl == "foreach":
        return [{"foreach": True}]
    if impl == "forloop":
        return [{"foreach": False}]
    # auto: fused kernels take the scaler's inv-scale and found-inf as device tensors, so
    # the step needs no `.item()`; foreach is the next best (fused over foreach SGD: a step
    # time ratio of 0.85 on a 2-core CPU, 0.95 on an H100; docs/benchmarks.md).
    return [{"fused": True}, {"foreach": device.type == "cuda"}]


def make_optimizer(task: Task, choice: str, params: list[nn.Parameter], lr: float,
                   device: torch.device, impl: str = "auto") -> torch.optim.Optimizer:
    """The task's own optimizer for `auto` when it has one, else AdamW or SGD, fused where possible."""
    if choice == "auto" and task.make_optimizer is not None:
        return task.make_optimizer(params, lr)
    kind = torch.optim.SGD if choice == "sgd" else torch.optim.AdamW
    attempts = optimizer_kwargs(impl, device)
    for kwargs in attempts[:-1]:
        try:
            return kind(params, lr=lr, **kwargs)
        except (RuntimeError, ValueError):
            continue
    return kind(params, lr=lr, **attempts[-1])
