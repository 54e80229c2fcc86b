"""Task functions that break the contract, for the CLI's error messages."""

from __future__ import annotations

from typing import Any

from torch import nn

from ddp_amp.tasks import Task


def returns_a_model(config: Any) -> nn.Module:
    return nn.Linear(2, 2)


def model_is_not_a_module(config: Any) -> Task:
    return Task(model="not a model", train_data=[(1, 2)], loss_fn=lambda o, t: o)  # type: ignore[arg-type]


def empty_train_set(config: Any) -> Task:
    return Task(model=nn.Linear(2, 2), train_data=[], loss_fn=nn.functional.mse_loss)


def empty_eval_set(config: Any) -> Task:
    return Task(model=nn.Linear(2, 2), train_data=[(1, 2)], loss_fn=nn.functional.mse_loss, eval_data=[],
                metric=lambda output, target: {})


def loss_fn_and_step_fn(config: Any) -> Task:
    return Task(model=nn.Linear(2, 2), train_data=[(1, 2)], loss_fn=nn.functional.mse_loss,
                step_fn=lambda model, batch: model(batch).sum())


def schedule_on_plateau_without_metric_name(config: Any) -> Task:
    return Task(model=nn.Linear(2, 2), train_data=[(1, 2)], loss_fn=nn.functional.mse_loss, schedule_on="eval")
