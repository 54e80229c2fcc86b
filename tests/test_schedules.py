"""`Task.schedule_on`: a metric-driven scheduler stepped with the eval metric after each
evaluation, and an epoch-wise one stepped once per pass over the data, which resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.multiproc import run_train

PLUGIN = "tests.plugins.scheduled_task:make_task"
LR = 0.01


def _run(on: str, run_dir: Path, steps: int, nproc: int = 0, *extra: str):
    return run_train(["--task", PLUGIN, "--task-opt", f"on={on}", "--task-opt", "hidden=16", "--task-opt",
                      "samples=288", "--batch-size", "32", "--lr", str(LR), "--log-every", "1", "--eval-every",
                      "4", "--max-steps", str(steps), "--precision", "fp32", "--run-dir", str(run_dir), *extra],
                     nproc=nproc)


def _lrs(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def _final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / "model.pt", weights_only=True)


def test_a_plateau_schedule_follows_the_eval_metric_on_two_ranks(tmp_path: Path) -> None:
    # Its resume (the scheduler's state and the LR across plateau drops, bit for bit) is
    # tests/test_example_word_lm.py's: the word-level LSTM stops and resumes past two drops.
    result = _run("eval", tmp_path, 16, 2)
    assert result.returncode == 0, result.stderr[-2000:]
    lrs = _lrs(tmp_path)
    # A 10% improvement is needed at each evaluation (every 4 steps); the LR only ever
    # halves, and only on an evaluation step, where the plateau was reached.
    changes = [step for step in range(2, 17) if lrs[step] != lrs[step - 1]]
    assert changes and all(step % 4 == 0 for step in changes), lrs
    assert all(lrs[s] in (LR * 0.5 ** k for k in range(5)) for s in lrs) and lrs[16] < LR


def test_an_epoch_schedule_steps_once_per_pass_and_resumes_exactly(tmp_path: Path) -> None:
    # 288 samples, 1/8 held out: 252 training items, batch 32 -> 7 steps per epoch.
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert _run("epoch", straight, 16).returncode == 0
    lrs = _lrs(straight)
    assert [lrs[s] for s in (1, 6, 7, 8, 13, 14, 15, 16)] == [LR, LR, LR / 2, LR / 2, LR / 2, LR / 4, LR / 4, LR / 4]
    assert _run("epoch", halves, 10).returncode == 0  # a resume from inside the second epoch
    assert _run("epoch", halves, 16).returncode == 0
    assert _lrs(halves) == lrs
    a, b = _final_weights(straight, 16), _final_weights(halves, 16)
    assert all(torch.equal(a[name], b[name]) for name in a)
