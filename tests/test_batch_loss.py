"""Batches that are not `(input, target)`: a task's own `step_fn`, dict batches, a forward
with two inputs, a model that computes its own loss; each through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_amp.errors import UsageError
from ddp_amp.tasks import Task
from ddp_amp.trainer.batch_loss import BatchLoss
from tests.multiproc import run_train

PLUGIN = "tests.plugins.own_step_task:make_task"


def _train(kind: str, run_dir: Path, *extra: str, nproc: int = 0, steps: int = 30):
    return run_train(["--task", PLUGIN, "--task-opt", f"kind={kind}", "--batch-size", "32", "--max-steps",
                      str(steps), "--log-every", "10", "--lr", "0.05", "--optimizer", "sgd", "--precision", "fp32",
                      "--run-dir", str(run_dir), *extra], nproc=nproc)


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record and "step" in record]


def test_dict_batches_train_through_a_step_fn_and_evaluate_through_an_eval_fn_on_two_ranks(tmp_path: Path) -> None:
    result = _train("dict_step", tmp_path, "--grad-accum", "2", "--eval-every", "10", nproc=2, steps=20)
    assert result.returncode == 0, result.stderr[-2000:]
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [10, 20]
    lines = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    evals = {r["step"]: r["eval_accuracy"] for r in lines if "eval_accuracy" in r}
    assert sorted(evals) == [0, 10, 20] and all(0.0 <= v <= 1.0 for v in evals.values())  # eval_fn's score
    assert all(0.0 <= r["train_accuracy"] <= 1.0 for r in records)  # the step_fn's own scalar, logged
    assert records[-1]["loss"] < records[0]["loss"]
    assert "train_accuracy=" in result.stdout


def test_a_forward_with_two_inputs_trains_through_a_step_fn(tmp_path: Path) -> None:
    result = _train("two_inputs", tmp_path, steps=20)
    assert result.returncode == 0, result.stderr[-2000:]
    records = _records(tmp_path)
    assert records[-1]["loss"] < records[0]["loss"]


def test_a_model_that_computes_its_own_loss_trains_and_resumes_exactly(tmp_path: Path) -> None:
    kind = "own_loss"
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert _train(kind, straight, steps=20).returncode == 0
    first = _train(kind, halves, steps=10)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _train(kind, halves, steps=20)
    assert again.returncode == 0, again.stderr[-2000:]
    records = _records(straight)
    assert records[-1]["loss"] < records[0]["loss"]
    final = [torch.load(run / "checkpoints" / "step-00000020" / "model.pt", weights_only=True)
             for run in (straight, halves)]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])


@pytest.mark.parametrize(("kind", "fragment"), [
    ("bad_result", "Task.step_fn's result='str': expected a loss tensor"),
    ("dict_loss_fn", "the task's batches='dict': expected (input, target) pairs for Task.loss_fn"),
])
def test_a_batch_the_task_cannot_turn_into_a_loss_is_one_line(kind: str, fragment: str, tmp_path: Path) -> None:
    result = _train(kind, tmp_path, steps=3)
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr
    assert "hint:" in result.stderr


def test_a_model_output_mapping_with_a_loss_is_the_loss_and_extras_keep_only_scalars() -> None:
    model = nn.Linear(3, 1)
    own = BatchLoss(Task(model=nn.Identity(), train_data=[0]))
    loss, extras = own(lambda **kw: {"loss": kw["x"].sum(), "logits": kw["x"]}, {"x": torch.ones(2)})
    assert loss.item() == 2.0 and extras is None
    stepped = BatchLoss(Task(model=model, train_data=[0], step_fn=lambda m, b: {
        "loss": m(b).sum(), "norm": b.norm(), "per_item": b.sum(1)}))
    loss, extras = stepped(model, torch.ones(4, 3))
    assert set(extras) == {"norm"} and not extras["norm"].requires_grad  # vectors are not logged
    with pytest.raises(UsageError, match="without a loss"):
        own(lambda x: x, torch.ones(2))
