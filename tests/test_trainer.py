"""The loop's numerical claims, tested directly with real gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddp_amp.amp import unwrap_model
from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.metrics import QuietRunLog
from ddp_amp.tasks import Task, load_task
from ddp_amp.trainer import Trainer, seed_everything, session_for
from tests.multiproc import in_turn, run_ranks

SMALL_MLP = ("in_size=16", "hidden=32", "out_size=4", "samples=512")


def _build(ctx: DistContext, options: dict[str, Any], task: Task | None = None) -> Trainer:
    config = TrainConfig(task="mlp", device="cpu", task_opt=SMALL_MLP, **options)
    seed_everything(config.seed)
    task = task or load_task(config.task, config)
    seed_everything(config.seed + ctx.rank)
    return Trainer(session_for(config).start(), config, task, QuietRunLog(ctx.rank))


def _train_and_return_weights(ctx: DistContext, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    trainer = _build(ctx, options)
    trainer.fit()
    return {k: v.clone() for k, v in unwrap_model(trainer.model).state_dict().items()}


def test_one_process_and_two_processes_reach_the_same_weights() -> None:
    """Global batch B on 1 rank == B/2 on each of 2 ranks, and == 2 x B/2 accumulated on 1."""
    options = {"batch_size": 32, "max_steps": 12, "log_every": 100, "precision": "fp32", "optimizer": "sgd",
               "lr": 0.05}
    # The two one-process runs share one process, one after the other (one start-up).
    ((single, accumulated),) = run_ranks(in_turn, 1, (_train_and_return_weights, options),
                                         (_train_and_return_weights, {**options, "grad_accum": 2}))
    pair = run_ranks(_train_and_return_weights, 2, options)
    initial = _build(DistContext(__import__("ddp_amp").DistEnv(), torch.device("cpu"), None), options)
    start = unwrap_model(initial.model).state_dict()
    for name, value in single.items():
        assert not torch.equal(value, start[name])  # training moved the weights
        assert torch.equal(pair[0][name], pair[1][name])  # replicas stay identical
        torch.testing.assert_close(pair[0][name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(accumulated[name], value, rtol=1e-5, atol=1e-6)


class _OverflowOnCall:
    """A loss that is finite except on the given calls, where it overflows fp16 gradients."""

    def __init__(self, bad_calls: set[int]) -> None:
        self.calls = 0
        self.bad_calls = bad_calls

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = nn.functional.mse_loss(output.float(), target)
        return loss * 1e38 if self.calls in self.bad_calls else loss


def _skip_two_steps(ctx: DistContext) -> dict[str, Any]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    task = Task(model=nn.Linear(4, 2), train_data=data, loss_fn=_OverflowOnCall({3, 4}),
                make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    trainer = _build(ctx, {"batch_size": 8, "max_steps": 6, "log_every": 100, "precision": "fp16"}, task)
    summary = trainer.fit()
    return {"summary": summary, "scheduler_steps": trainer.scheduler.last_epoch,
            "lr": trainer.optimizer.param_groups[0]["lr"]}


def test_skipped_fp16_steps_do_not_advance_the_scheduler() -> None:
    (result,) = run_ranks(_skip_two_steps, 1)
    summary = result["summary"]
    skipped = summary["skipped_total"]
    # the two forced overflows, plus any the initial scale of 2**16 causes on its own
    assert summary["steps"] == 6 and 2 <= skipped < 6 and summary["steps_taken"] == 6 - skipped
    assert result["scheduler_steps"] == 6 - skipped
    assert result["lr"] == 1e-3 * 0.5 ** (6 - skipped)
    assert summary["loss_scale"] == 2.0**16 / 2**skipped  # backed off once per skip
