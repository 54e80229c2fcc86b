"""Several optimizers from one task: one agreed skip decision steps them all or none, on
every rank, and a checkpoint holds each one's state, so a resume is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddp_amp.amp import unwrap_model
from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.trainer import build_trainer, seed_everything, session_for
from tests.multiproc import run_ranks, run_train

PLUGIN = "tests.plugins.two_optimizers_task:make_task"


def _steps_with_an_inf_in_one_optimizer(ctx: DistContext) -> dict[str, Any]:
    config = TrainConfig(task=PLUGIN, task_opt=("inf_at=3",), precision="fp16", device="cpu", batch_size=16,
                         loss_scale_init=256.0, max_steps=100, log_every=100)
    seed_everything(config.seed)
    trainer = build_trainer(session_for(config).start(), config)
    body, head = unwrap_model(trainer.model)[0].weight, unwrap_model(trainer.model)[2].weight
    changed, skipped = [], []
    for _ in range(5):
        before = (body.detach().clone(), head.detach().clone())
        trainer.train_step()
        changed.append((not torch.equal(before[0], body), not torch.equal(before[1], head)))
        skipped.append(int(trainer.scaler.last_step_skipped().item()))
    return {"changed": changed, "skipped": skipped, "optimizers": len(trainer.optimizers),
            "body": body.detach().clone()}


def test_an_inf_in_one_optimizers_gradients_on_one_rank_skips_both_on_every_rank() -> None:
    ranks = run_ranks(_steps_with_an_inf_in_one_optimizer, 2)
    for facts in ranks:
        assert facts["optimizers"] == 2
        assert facts["skipped"] == [0, 0, 1, 0, 0]
        # torch's own GradScaler would step the body's optimizer at step 3 (its gradients
        # are finite); here both stand still, and both move on every other step.
        assert facts["changed"] == [(True, True), (True, True), (False, False), (True, True), (True, True)]
    assert torch.equal(ranks[0]["body"], ranks[1]["body"])


def test_two_optimizers_checkpoint_and_resume_bitwise(tmp_path: Path) -> None:
    args = ["--task", PLUGIN, "--precision", "fp16", "--batch-size", "16",
            "--loss-scale-init", "256"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert run_train([*args, "--max-steps", "6", "--run-dir", str(straight)]).returncode == 0
    first = run_train([*args, "--max-steps", "3", "--run-dir", str(halves)])
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_train([*args, "--max-steps", "6", "--run-dir", str(halves)])
    assert again.returncode == 0, again.stderr[-2000:]
    load = lambda run, name: torch.load(run / "checkpoints" / "step-00000006" / name, weights_only=True)  # noqa: E731
    assert len(load(straight, "state.pt")["optimizer"]) == 2  # each optimizer's own state
    a, b = load(straight, "model.pt"), load(halves, "model.pt")
    assert all(torch.equal(a[name], b[name]) for name in a)
    moments = [_tensors(load(run, "state.pt")["optimizer"]) for run in (straight, halves)]
    assert len(moments[0]) == len(moments[1]) > 0
    assert all(torch.equal(x, y) for x, y in zip(*moments))  # Adam's moments too


def _tensors(states: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [value for state in states for per_param in state["state"].values() for value in per_param.values()
            if isinstance(value, torch.Tensor)]
