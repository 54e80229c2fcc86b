"""Crashes with real processes: a rank SIGKILLed under torchrun, a writer killed mid-write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ddp_amp.checkpoint import safe_load, verify_checkpoint
from tests.resume_harness import TASK, assert_bitwise_equal
from tests.multiproc import REPO_ROOT, kill_when, run_train, slow_writes_env

COMMON = ["--task", TASK, "--batch-size", "8", "--device", "cpu", "--log-every", "1000"]


def _final(run_dir: Path, step: int) -> dict[str, object]:
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    verify_checkpoint(path)
    train = safe_load(path / "state.pt")
    return {"model": safe_load(path / "model.pt"), "optimizer": train["optimizer"],
            "scheduler": train["scheduler"], "step": train["step"]}


def test_rank_killed_under_torchrun_restarts_and_matches_straight_run(tmp_path: Path) -> None:
    args = COMMON + ["--max-steps", "8", "--ckpt-every", "3"]
    crashed = run_train(args + ["--run-dir", str(tmp_path / "crashed"), "--task-opt", "kill_at=5",
                                "--task-opt", "kill_rank=1"], nproc=2, torchrun_args=("--max-restarts=1",))
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "exitcode: -9" in crashed.stderr  # the rank really died by SIGKILL
    # The survivor named it, once, before torchrun restarted both (test_liveness.py has the line).
    assert crashed.stderr.count("ddp_amp: rank 1 went silent") == 1, crashed.stderr[-3000:]
    assert "resumed from" in crashed.stdout and "step-00000003" in crashed.stdout, crashed.stdout
    straight = run_train(args + ["--run-dir", str(tmp_path / "straight")], nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_bitwise_equal(_final(tmp_path / "straight", 8), _final(tmp_path / "crashed", 8))


def test_writer_killed_mid_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "ddp_amp.train", *COMMON, "--max-steps", "6", "--ckpt-every", "2",
               "--run-dir", str(tmp_path)]
    # Each file of a checkpoint written 0.3 s slower (tests/slow_writes), so the kill lands inside the step-4 write.
    proc = subprocess.Popen(command, env=slow_writes_env(0.3), cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when(proc, lambda: any(root.glob(".tmp-step-00000004-*/model.pt")), "the step-4 write")
    assert not (root / "step-00000004").exists()
    verify_checkpoint(root / "step-00000002")  # the previous one is whole
    resumed = run_train(COMMON + ["--max-steps", "6", "--ckpt-every", "2", "--run-dir", str(tmp_path)])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {root / 'step-00000002'} at step 2" in resumed.stdout, resumed.stdout
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
