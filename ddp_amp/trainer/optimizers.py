"""The run's optimizer: the task's own, or AdamW / SGD with the fastest kernels available."""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

from ddp_amp.errors import UsageError
from ddp_amp.session import Session
from ddp_amp.tasks import Task


class KernelChoice(TypedDict, total=False):
    """The keywords torch's AdamW and SGD take to pick their kernel."""

    fused: bool
    foreach: bool


def optimizer_kwargs(impl: str, device: torch.device, fused_takes: bool = True) -> list[KernelChoice]:
    """Keyword choices to try in order for `--optimizer-impl` (fused may be unavailable, and
    where `fused_takes` is False its kernel does not take these parameters)."""
    if impl == "fused":
        return [{"fused": True}]
    if impl == "foreach":
        return [{"foreach": True}]
    if impl == "forloop":
        return [{"foreach": False}]
    # auto: fused kernels take the scaler's inv-scale and found-inf as device tensors, so
    # the step needs no `.item()`; foreach is the next best (fused over foreach SGD: a step
    # time ratio of 0.85 on a 2-core CPU, 0.95 on an H100; docs/benchmarks.md).
    fused: list[KernelChoice] = [{"fused": True}] if fused_takes else []
    return fused + [{"foreach": device.type == "cuda"}]


def make_optimizers(task: Task, choice: str, params: list[nn.Parameter], lr: float,
                    device: torch.device, impl: str = "auto") -> tuple[torch.optim.Optimizer, ...]:
    """The task's own optimizer(s) for `auto` when it has them (its `make_optimizer` may return
    several, e.g. a GAN's two), else one AdamW or SGD, fused where possible."""
    if choice == "auto" and task.make_optimizer is not None:
        made = task.make_optimizer(params, lr)
        optimizers = tuple(made) if isinstance(made, (list, tuple)) else (made,)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise UsageError("Task.make_optimizer's result", type(made).__name__,
                             "a torch.optim.Optimizer, or a list of them", "return the optimizer(s) you built")
        return optimizers
    return (_built_in(choice, params, lr, device, impl),)


def make_optimizer(task: Task, choice: str, params: list[nn.Parameter], lr: float,
                   device: torch.device, impl: str = "auto") -> torch.optim.Optimizer:
    """The run's one optimizer (`make_optimizers`, for a task that makes exactly one)."""
    optimizers = make_optimizers(task, choice, params, lr, device, impl)
    if len(optimizers) != 1:
        raise UsageError("Task.make_optimizer's result", f"{len(optimizers)} optimizers", "one optimizer here",
                         "use ddp_amp.trainer.make_optimizers for several")
    return optimizers[0]


def _built_in(choice: str, params: list[nn.Parameter], lr: float,
              device: torch.device, impl: str = "auto") -> torch.optim.Optimizer:
    """AdamW (for `auto` and `adamw`) or SGD, fused where possible."""
    kind = torch.optim.SGD if choice == "sgd" else torch.optim.AdamW
    attempts = optimizer_kwargs(impl, device, Session.fused_kernel_takes(kind, params))
    for kwargs in attempts[:-1]:
        try:
            return kind(params, lr=lr, **kwargs)
        except (RuntimeError, ValueError):
            continue
    return kind(params, lr=lr, **attempts[-1])
