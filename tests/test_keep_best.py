"""`--keep-best METRIC[:min|max]`: the best checkpoint by an eval metric is saved, kept by
retention beside the last K, carried across a resume, and used for the test pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_amp.checkpoint import BestRecord, apply_retention, read_best, write_best
from ddp_amp.config import TrainConfig
from ddp_amp.tasks import load_task
from tests.multiproc import run_train

PLUGIN = "tests.plugins.tested_task:make_task"
# fp32 as the recomputed expectation below: `auto` is bf16 on a CPU with bf16 units.
SMALL = ["--task", PLUGIN, "--task-opt", "hidden=16", "--task-opt", "samples=512", "--batch-size", "32",
         "--lr", "0.01", "--eval-every", "5", "--ckpt-every", "5", "--keep-last", "1", "--log-every", "5",
         "--precision", "fp32"]


def _evals(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["eval_mse"] for r in records if "eval_mse" in r and "loss" not in r}


def test_the_best_checkpoint_is_kept_beside_the_last_across_a_resume_and_tested(tmp_path: Path) -> None:
    # The eval mse falls as training goes on, so its *largest* value after training began
    # is the first one (step 5): a best that is not the newest checkpoint.
    first = run_train([*SMALL, "--keep-best", "eval_mse:max", "--max-steps", "15", "--run-dir", str(tmp_path)],
                      nproc=2)
    assert first.returncode == 0, first.stderr[-2000:]
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000005", "step-00000015"]
    best = read_best(root)
    evals = _evals(tmp_path)
    assert best is not None and best.step == 5 and best.value == pytest.approx(evals[5], rel=1e-12)

    again = run_train([*SMALL, "--keep-best", "eval_mse:max", "--max-steps", "30", "--run-dir", str(tmp_path)],
                      nproc=2)
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000005", "step-00000030"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_step"] == 5 and summary["best_metric"] == "eval_mse"
    assert summary["test_weights_from_step"] == 5
    # The test pass scored the best checkpoint's weights: recompute it from that file.
    config = TrainConfig(task=PLUGIN, task_opt=("hidden=16", "samples=512"))
    task = load_task(PLUGIN, config)
    task.model.load_state_dict(torch.load(root / "step-00000005" / "model.pt", weights_only=True))
    inputs, targets = zip(*(task.test_data[i] for i in range(len(task.test_data))))
    with torch.no_grad():
        expected = nn.functional.mse_loss(task.model(torch.stack(inputs)), torch.stack(targets)).item()
    assert summary["test_mse"] == pytest.approx(expected, rel=1e-4)


def test_a_metric_the_task_does_not_report_is_one_line_before_training(tmp_path: Path) -> None:
    result = run_train([*SMALL, "--keep-best", "eval_accuracy:max", "--max-steps", "10", "--run-dir",
                        str(tmp_path)])
    assert result.returncode == 2
    assert "--keep-best='eval_accuracy:max': expected a metric the task's evaluation reports (eval_mse)" \
        in result.stderr
    assert "Traceback" not in result.stderr and not list((tmp_path / "checkpoints").glob("step-*"))


def test_a_bad_spec_is_refused_at_parse_time() -> None:
    with pytest.raises(Exception, match="--keep-best='eval_mse:best': expected METRIC or METRIC:min"):
        TrainConfig(keep_best="eval_mse:best")


def test_retention_never_deletes_the_best(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        (tmp_path / f"step-{step:08d}").mkdir()
    write_best(tmp_path, BestRecord("eval_nll", "min", 1.5, 2))
    removed = apply_retention(tmp_path, 1, tmp_path / "step-00000004")
    assert sorted(p.name for p in removed) == ["step-00000001", "step-00000003"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert BestRecord("m", "min", 1.0, 1).beaten_by(0.5) and not BestRecord("m", "max", 1.0, 1).beaten_by(0.5)
    assert not BestRecord("m", "min", 1.0, 1).beaten_by(float("nan"))
