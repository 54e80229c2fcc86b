"""The one way to build a Trainer: seeding and the task in the order every rank needs."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddp_amp.config import TrainConfig
from ddp_amp.errors import UsageError
from ddp_amp.metrics import QuietRunLog, RunLog
from ddp_amp.option_values import METRIC_GOAL
from ddp_amp.session import Session
from ddp_amp.tasks import Task, load_task
from ddp_amp.trainer.evaluation import check_metric_names, reported_metrics
from ddp_amp.trainer.loop import Trainer, build_task_model


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_task(config: TrainConfig, session: Session,
                 check_weights: Callable[[Task], Collection[str]] | None = None) -> Task:
    """Check the batch geometry, build the task with the same model on every rank, check the
    options that name its metrics, then seed each rank's own streams (dropout, augmentation)
    with `seed + rank`. `check_weights(task)`, before the model is built: the names of the
    parameters a load fills next (pretrained weights), whose init the build need not draw."""
    # fail on a bad batch size before any work; the ranks of a tensor- or context-parallel group share a batch
    ctx = session.ctx
    config.data_options().micro_batch_size(ctx.dp_size, "world size" if ctx.dp_size == ctx.world_size else
                                           "data-parallel ranks (world size / (--tensor-parallel x "
                                           "--context-parallel))")
    seed_everything(config.seed)  # same model init on every rank
    task = load_task(config.task, config)
    overwritten = check_weights(task) if check_weights is not None else ()
    if task.build_model is not None and not session.sharded:
        task.model = build_task_model(session, config, task, overwritten)
    if task.model is not None:  # else it is built sharded with the Trainer, which checks them then
        check_metric_options(config, task, session)
    seed_everything(config.seed + session.rank)
    return task


def check_metric_options(config: TrainConfig, task: Task, session: Session, model: nn.Module | None = None) -> None:
    """`--keep-best` and `Task.schedule_on="eval:METRIC"` name metrics the task's evaluation
    reports; a one-line UsageError where one does not (no collective, except through a
    sharded `model`, the task's own by default: every rank scores one item)."""
    wanted: dict[str, tuple[str, str, str]] = {}
    keep_best = config.checkpoint_options().keep_best
    if keep_best is not None:
        if task.eval_data is None:
            raise UsageError("--keep-best", METRIC_GOAL.text(keep_best), "a task with eval_data",
                             "the best checkpoint is chosen by an eval metric; drop --keep-best")
        wanted[keep_best.metric] = ("--keep-best", METRIC_GOAL.text(keep_best), "--keep-best {name}")
    kind, _, metric = task.schedule_on.partition(":")
    if kind == "eval":
        wanted[metric] = ("Task.schedule_on", task.schedule_on, "schedule_on='eval:{name}'")
    if wanted:
        check_metric_names(reported_metrics(task, session, model), wanted)


def build_trainer(session: Session, config: TrainConfig, run_log: RunLog | None = None, *,
                  task: Task | None = None, checkpoint_root: Path | None = None,
                  overwritten: Collection[str] = ()) -> Trainer:
    """A Trainer for this rank of `session` (collective: DDP's wrap broadcasts the weights).

    `task` defaults to the config's, made by `prepare_task`; pass it where the caller made
    it earlier (the CLI checks everything before it writes anything). `run_log` defaults to
    a quiet one; without `checkpoint_root` nothing is saved. `overwritten`: parameters the
    caller loads next, whose init the build does not draw.
    """
    task = task if task is not None else prepare_task(config, session)
    trainer = Trainer(session, config, task, run_log or QuietRunLog(session.rank), checkpoint_root, overwritten)
    if task.model is None:  # built by the Trainer: its metrics could not be checked before
        check_metric_options(config, task, session, session.unwrap(trainer.model))
    return trainer
