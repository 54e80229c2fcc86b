"""`Task.state`: what a task carries across steps (a TBPTT hidden state) is saved per rank
in every checkpoint, each rank's in its own file, and given back on resume, so the run
continues bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.multiproc import run_train

PLUGIN = "tests.plugins.carried_state_task:make_task"


def _run(run_dir: Path, steps: int, nproc: int = 2):
    return run_train(["--task", PLUGIN, "--batch-size", "16", "--max-steps", str(steps), "--optimizer", "sgd",
                      "--precision", "fp32", "--ckpt-every", "4", "--run-dir", str(run_dir)], nproc=nproc)


def _load(run_dir: Path, step: int, name: str) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / name, weights_only=True)


def test_a_carried_hidden_state_resumes_bitwise_on_two_ranks_and_only_there(tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert _run(straight, 12).returncode == 0
    first = _run(halves, 6)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _run(halves, 12)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout
    # Each rank's file holds its own state, and only its own; rank 0 wrote no file of every rank's.
    owns = [_load(straight, 12, f"per_rank/rank-0000{rank}.pt") for rank in (0, 1)]
    assert all(set(own) == {"task_state"} and set(own["task_state"]) == {"value"} for own in owns)
    states = [own["task_state"] for own in owns]
    assert not torch.equal(states[0]["value"], states[1]["value"])
    assert not (straight / "checkpoints" / "step-00000012" / "task_state.pt").exists()
    resumed = [_load(halves, 12, f"per_rank/rank-0000{rank}.pt")["task_state"] for rank in (0, 1)]
    assert all(torch.equal(a["value"], b["value"]) for a, b in zip(states, resumed))
    a, b = _load(straight, 12, "model.pt"), _load(halves, 12, "model.pt")
    assert all(torch.equal(a[name], b[name]) for name in a)

    # Each rank's state belongs to its rank: another world size is refused, in one line.
    other = _run(halves, 16, nproc=0)
    assert other.returncode == 2
    assert "expected a checkpoint of 1 rank(s), as the task keeps state per rank" in other.stderr
    assert "Traceback" not in other.stderr
