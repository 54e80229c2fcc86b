"""The one way to build a Trainer: seeding and the task in the order every rank needs."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.metrics import QuietRunLog, RunLog
from ddp_amp.session import Session
from ddp_amp.tasks import Task, load_task
from ddp_amp.trainer.loop import Trainer


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_task(config: TrainConfig, ctx: DistContext) -> Task:
    """Check the batch geometry, build the task with the same model on every rank, then
    seed each rank's own streams (dropout, augmentation) with `seed + rank`."""
    config.micro_batch_size(ctx.world_size)  # fail on a bad batch size before any work
    seed_everything(config.seed)  # same model init on every rank
    task = load_task(config.task, config)
    seed_everything(config.seed + ctx.rank)
    return task


def build_trainer(session: Session, config: TrainConfig, run_log: RunLog | None = None, *,
                  task: Task | None = None, checkpoint_root: Path | None = None) -> Trainer:
    """A Trainer for this rank of `session` (collective: DDP's wrap broadcasts the weights).

    `task` defaults to the config's, made by `prepare_task`; pass it where the caller made
    it earlier (the CLI checks everything before it writes anything). `run_log` defaults to
    a quiet one; without `checkpoint_root` nothing is saved.
    """
    task = task if task is not None else prepare_task(config, session.ctx)
    return Trainer(session, config, task, run_log or QuietRunLog(session.rank), checkpoint_root)
