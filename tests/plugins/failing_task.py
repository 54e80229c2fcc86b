"""A plugin task that fails on one rank only, at a chosen point, for the failure tests.

Task options: `fail_at` = build | step | eval | checkpoint, `fail_rank` (default 1),
`fail_step` (the loss call that fails, default 3), `error` = usage | runtime | memory.
`checkpoint` gives rank 0's model an extra state that no checkpoint can hold, so rank 0's
write fails (the other ranks have nothing to write).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp import Task, TrainConfig, UsageError


def _error(kind: str, where: str, rank: int) -> Exception:
    text = f"planted failure in {where} on rank {rank}"
    if kind == "usage":
        return UsageError("--task-opt fail_at", where, "a task that does not fail", text)
    if kind == "memory":
        return MemoryError(f"out of memory (simulated): {text}")
    return RuntimeError(text)


class _Model(nn.Sequential):
    def __init__(self, unsaveable: bool) -> None:
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.unsaveable = unsaveable

    def get_extra_state(self) -> Any:
        return (lambda: 0) if self.unsaveable else None

    def set_extra_state(self, state: Any) -> None:
        pass


def make_task(config: TrainConfig) -> Task:
    options = config.task_options()
    where, kind = options.get("fail_at", "step"), options.get("error", "runtime")
    fail_rank, fail_step = int(options.get("fail_rank", "1")), int(options.get("fail_step", "3"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    failing = rank == fail_rank
    if where == "build" and failing:
        raise _error(kind, where, rank)
    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(256, 8, generator=generator)
    data = TensorDataset(inputs, inputs[:, :2])
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if where == "step" and failing and calls[0] == fail_step:
            raise _error(kind, where, rank)
        return nn.functional.mse_loss(output.float(), target)

    def metric(output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        if where == "eval" and failing:
            raise _error(kind, where, rank)
        return {"mse": (nn.functional.mse_loss(output.float(), target, reduction="sum"), target.numel())}

    model = _Model(unsaveable=where == "checkpoint" and rank == 0)
    return Task(model=model, train_data=data, loss_fn=loss_fn, eval_data=data, metric=metric, name="failing")
