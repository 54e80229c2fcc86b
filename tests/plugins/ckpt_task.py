"""A tiny plugin task for the checkpoint tests: dropout, a scheduler, and a test-chosen crash.

Task options (`--task-opt KEY=VALUE`):
- `hidden`: width (a different width makes a checkpoint of "another model");
- `loss_mult`: multiplies the loss; a large value overflows fp16 so the scaler skips steps;
- `kill_at`, `kill_rank`: on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0) the
  rank `kill_rank` SIGKILLs itself as it starts optimizer step `kill_at + 1`;
- `hang_at` (with `kill_rank`): that rank sleeps forever there instead, a hang in its own code;
- `stop_at` (with `kill_rank`): that rank stops itself there (SIGSTOP): alive, but silent;
- `gil_at` (with `kill_rank`, `gil_s`): that rank spends `gil_s` seconds there in one C call
  that keeps the GIL (libc's `sleep` through ctypes.PyDLL, which does not release it), as a
  big `torch.load` or `sorted` does: every Python thread of the process pauses, then it goes
  on; without `gil_s` it never returns (a hang with the GIL held).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp import Task, TrainConfig

SAMPLES = 96  # 2 ranks x micro-batch 4 -> 12 micro-batches per rank per epoch


def _kill_hook(kill_at: int, kill_rank: int, grad_accum: int, how: str, gil_s: int = 0) -> Any:
    calls = [0]

    def hook(module: nn.Module, args: Any) -> None:
        calls[0] += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))  # torchrun's, else srun's
        if first_attempt and rank == kill_rank and \
                calls[0] == kill_at * grad_accum + 1:
            if how == "hang":
                threading.Event().wait()
            if how == "gil":
                libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole call
                while True:
                    libc.sleep(gil_s or 3600)
                    if gil_s:
                        return
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    return hook


def make_task(config: TrainConfig) -> Task:
    options = config.task_options()
    hidden = int(options.get("hidden", "16"))
    loss_mult = float(options.get("loss_mult", "1"))
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, 8, generator=generator)
    targets = torch.sin(inputs[:, :4] * 2)
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 4))
    for how in ("kill", "hang", "stop", "gil"):
        if f"{how}_at" in options:
            model.register_forward_pre_hook(_kill_hook(int(options[f"{how}_at"]), int(options.get("kill_rank", "1")),
                                                       config.grad_accum, how, int(options.get("gil_s", "0"))))

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output.float(), target) * loss_mult

    return Task(
        model=model,
        train_data=TensorDataset(inputs, targets),
        loss_fn=loss_fn,
        make_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7),
        default_lr=1e-2,
        name="ckpt_task",
    )
