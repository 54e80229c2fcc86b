"""A run is what it says it is: its own directory, one job at a time, no silent config drift.

Real processes throughout: plain `python -m ddp_amp.train`, real torchrun with a shared
rendezvous id, the repository's launch/multinode.sh.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddp_amp.checkpoint import Checkpointer, verify_checkpoint
from tests.multiproc import REPO_ROOT, cli_env, free_port, kill_when, run_train
from tests.resume_harness import TASK

MLP = ["--task", "mlp", "--device", "cpu", "--batch-size", "8", "--eval-every", "0", "--task-opt", "hidden=16",
       "--task-opt", "samples=256"]
TRAIN = [sys.executable, "-m", "ddp_amp.train"]


def _start_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if " start: " in line)


def _run_dirs(cwd: Path) -> list[str]:
    return sorted(p.name for p in (cwd / "runs").iterdir())


def test_torchrun_launches_sharing_rendezvous_id_none_are_separate_runs_and_a_restart_finds_its_own(
        tmp_path: Path) -> None:
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=none"]
    args = ["--task", TASK, "--batch-size", "8", "--device", "cpu", "--log-every", "1000", "--max-steps", "6",
            "--ckpt-every", "3"]
    first = subprocess.run([*torchrun, "-m", "ddp_amp.train", *args], capture_output=True, text=True,
                           timeout=240, env=cli_env(), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "start: fresh run" in _start_line(first.stdout)
    # The second launch: rank 1 dies at step 4 and torchrun restarts the workers. The
    # restart must resume this launch's own step 3, never the first launch's step 6.
    second = subprocess.run([*torchrun, "--max-restarts=1", "-m", "ddp_amp.train", *args, "--task-opt", "kill_at=4",
                             "--task-opt", "kill_rank=1"], capture_output=True, text=True, timeout=240,
                            env=cli_env(), cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    runs = _run_dirs(tmp_path)
    assert len(runs) == 2, runs
    starts = [line for line in second.stdout.splitlines() if " start: " in line]
    assert "start: fresh run" in starts[0] and "at step 3" in starts[1], starts
    own = next(name for name in runs if name in starts[0])
    assert f"runs/{own}/checkpoints/step-00000003" in starts[1]
    for name in runs:
        assert json.loads((tmp_path / "runs" / name / "summary.json").read_text())["steps"] == 6


def test_two_multinode_launches_on_one_node_are_separate_runs(tmp_path: Path) -> None:
    for _ in range(2):
        env = cli_env(PYTHON=sys.executable, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NNODES="1",
                      NPROC_PER_NODE="2")
        result = subprocess.run(["bash", str(REPO_ROOT / "launch" / "multinode.sh"), *MLP, "--max-steps", "4"],
                                capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "start: fresh run" in _start_line(result.stdout)
        time.sleep(1.1)  # the generated id has a seconds clock and the pid; keep even the clock apart
    runs = _run_dirs(tmp_path)
    assert len(runs) == 2 and all(name.startswith("mlp-") for name in runs), runs


def test_multinode_without_run_id_on_several_nodes_is_refused(tmp_path: Path) -> None:
    env = cli_env(PYTHON=sys.executable, MASTER_ADDR="127.0.0.1", NNODES="2")
    result = subprocess.run(["bash", str(REPO_ROOT / "launch" / "multinode.sh"), *MLP], capture_output=True,
                            text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 2 and "set RUN_ID" in result.stderr


# Steps of a set wall time (20 ms), and more of them than any test waits for: a holder runs
# until the test stops it, so it still runs when a second job starts however loaded the machine.
PACED = ["--task", "tests.plugins.paced_task:make_task", "--device", "cpu", "--batch-size", "8", "--eval-every", "0",
         "--task-opt", "step_ms=20"]


def test_a_second_job_on_a_run_directory_stops_at_once_and_a_killed_holders_restart_gets_it(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "shared"
    long_run = [*TRAIN, *PACED, "--max-steps", "100000", "--ckpt-every", "150", "--log-every", "1000",
                "--run-dir", str(run_dir)]
    holder = subprocess.Popen(long_run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=cli_env(), cwd=REPO_ROOT)
    assert holder.stdout is not None and " start: fresh run" in holder.stdout.readline()
    second = run_train([*PACED, "--max-steps", "10", "--run-dir", str(run_dir)], timeout=60)
    # "At once": it ended while the holder still ran, so it did not wait for the lock.
    assert holder.poll() is None, "the holder ended before the second job did"
    assert second.returncode == 2, second.stdout[-2000:]
    assert f"pid {holder.pid}" in second.stderr and "no other job is using" in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    holder.send_signal(signal.SIGTERM)  # a stop: checkpoint, then exit 128 + 15
    _, err = holder.communicate(timeout=240)
    assert holder.returncode == 143, err[-3000:]
    for _, path in Checkpointer.steps(Checkpointer.root_of(run_dir)):
        verify_checkpoint(path)  # the holder's work is intact
    # A holder killed with SIGKILL leaves no stale lock: its restart takes the directory.
    killed = subprocess.Popen(long_run, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cli_env(),
                              cwd=REPO_ROOT)
    lock = run_dir / ".lock"
    kill_when(killed, lambda: f'"pid": {killed.pid}' in lock.read_text(), "the lock")
    newest = Checkpointer.steps(Checkpointer.root_of(run_dir))[-1][0]
    restart = run_train([*PACED, "--max-steps", str(newest + 10), "--run-dir", str(run_dir)])
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "start: resume from" in _start_line(restart.stdout)


def _first_run(run_dir: Path) -> None:
    result = run_train([*MLP, "--max-steps", "4", "--ckpt-every", "2", "--run-dir", str(run_dir)])
    assert result.returncode == 0, result.stderr[-3000:]


def test_settings_that_must_match_are_refused_field_by_field_and_nothing_is_written(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _first_run(run_dir)
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    refused = run_train([*MLP, "--max-steps", "6", "--run-dir", str(run_dir), "--seed", "1", "--optimizer", "sgd",
                         "--task-opt", "hidden=32"])
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert lines[0].startswith("ddp_amp: error: --resume=") and "--allow-change" in lines[0]
    assert "--allow-change optimizer,seed,task_opt" in lines[0] or "task_opt" in lines[0]
    assert "  --seed: saved 0, now 1" in lines and "  --optimizer: saved 'auto', now 'sgd'" in lines
    assert any(line.startswith("  --task-opt: saved") and "hidden=32" in line for line in lines)
    assert "Traceback" not in refused.stderr and " start: " not in refused.stdout
    after = {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert {k: v for k, v in after.items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


def test_an_accepted_optimizer_change_starts_it_fresh_and_a_new_lr_is_applied(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _first_run(run_dir)
    changed = run_train([*MLP, "--max-steps", "6", "--run-dir", str(run_dir), "--optimizer", "sgd",
                         "--allow-change", "optimizer", "--lr", "0.05", "--log-every", "1"])
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert "--optimizer: saved 'auto', now 'sgd': the new value applies" in changed.stdout
    assert "the optimizer changed from AdamW to SGD (--allow-change optimizer): it starts fresh" in changed.stdout
    assert "--log-every: saved 20, now 1: the new value applies" in changed.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if r.get("step", 0) > 4 and "lr" in r] == [0.05, 0.05]
    # Same optimizer, new --lr: the restored optimizer's rates are rescaled, and said so.
    again = run_train([*MLP, "--max-steps", "8", "--run-dir", str(run_dir), "--optimizer", "sgd",
                       "--lr", "0.02", "--log-every", "1"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--lr 0.02 (saved 0.05): the optimizer's learning rates are now 0.02" in again.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if r.get("step", 0) > 6 and "lr" in r] == [0.02, 0.02]


def test_resume_none_refuses_a_directory_with_checkpoints_unless_they_are_archived(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _first_run(run_dir)
    refused = run_train([*MLP, "--max-steps", "4", "--run-dir", str(run_dir), "--resume", "none"])
    assert refused.returncode == 2 and "--archive-checkpoints" in refused.stderr, refused.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    # Archived, the new run starts fresh; killed before its first checkpoint, its next
    # resume starts fresh again instead of picking up the old run's step 4.
    fresh = subprocess.Popen([*TRAIN, *MLP, "--max-steps", "100000", "--ckpt-every", "50000", "--run-dir",
                              str(run_dir), "--resume", "none", "--archive-checkpoints"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO_ROOT)
    assert fresh.stdout is not None and " start: fresh run" in fresh.stdout.readline()
    kill_when(fresh, lambda: True, "the start")
    archived = [p for p in run_dir.iterdir() if p.name.startswith("checkpoints-archived-")]
    assert len(archived) == 1 and sorted(p.name for p in archived[0].iterdir()) == ["step-00000002",
                                                                                   "step-00000004"]
    after_crash = run_train([*MLP, "--max-steps", "2", "--run-dir", str(run_dir)])
    assert after_crash.returncode == 0, after_crash.stderr[-3000:]
    assert "start: fresh run" in _start_line(after_crash.stdout)


def test_resume_from_a_missing_path_creates_nothing(tmp_path: Path) -> None:
    result = subprocess.run([*TRAIN, *MLP, "--resume", str(tmp_path / "nonexistent")], capture_output=True,
                            text=True, timeout=120, env=cli_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "expected an existing checkpoint directory" in result.stderr
    assert result.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == []


def _without_flock_env() -> dict[str, str]:
    """`cli_env` for a process whose `flock` fails as on Lustre without `-o flock` (ENOSYS):
    tests/no_flock/sitecustomize.py, loaded by Python at start-up; ddp_amp itself is untouched."""
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "tests" / "no_flock"), env["PYTHONPATH"]])
    return env


def _lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_without_flock_a_lock_file_refuses_a_second_job_and_only_a_provably_dead_holders_is_taken_over(
        tmp_path: Path) -> None:
    env = _without_flock_env()
    # Two runs one after the other in one place: each starts, says once that the fallback is
    # in use, completes, and leaves no lock file behind for the next.
    run_dir = tmp_path / "lustre"
    owner = run_dir / ".lock.owner"
    for steps, start in ((4, "start: fresh run"), (8, "start: resume from")):
        run = run_train([*MLP, "--max-steps", str(steps), "--ckpt-every", "4", "--run-dir", str(run_dir)], env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        assert start in _start_line(run.stdout)
        notices = _lines_with(run.stderr, "does not support flock")
        assert len(notices) == 1 and str(owner) in notices[0], run.stderr
        assert not owner.exists()
    # A holder that runs until this test kills it: a second job is refused in one line naming it.
    held = tmp_path / "held"
    owner = held / ".lock.owner"
    holder = subprocess.Popen([*TRAIN, *PACED, "--max-steps", "100000", "--ckpt-every", "100000", "--log-every",
                               "1000", "--run-dir", str(held)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=REPO_ROOT)
    assert holder.stdout is not None and " start: fresh run" in holder.stdout.readline()
    second = run_train([*PACED, "--max-steps", "10", "--run-dir", str(held)], env=env, timeout=60)
    assert holder.poll() is None, "the holder ended before the second job started"
    assert second.returncode == 2, second.stdout[-2000:]
    assert f"pid {holder.pid}" in second.stderr and "no other job is using" in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1, second.stderr
    # Killed with SIGKILL, it leaves its lock file: nothing removes it but a later job's proof.
    kill_when(holder, lambda: f'"pid": {holder.pid}' in owner.read_text(), "the lock file")
    _, err = holder.communicate(timeout=30)
    assert len(_lines_with(err, "does not support flock")) == 1, err
    stale = owner.read_text()
    # Named on another host, it cannot be judged from here: refused, with how to remove it.
    owner.write_text(json.dumps({**json.loads(stale), "host": "other-node.example"}) + "\n")
    foreign = run_train([*PACED, "--max-steps", "4", "--run-dir", str(held)], env=env, timeout=60)
    assert foreign.returncode == 2, foreign.stdout[-2000:]
    assert len(foreign.stderr.strip().splitlines()) == 1, foreign.stderr
    assert "other-node.example" in foreign.stderr and f"rm {owner}" in foreign.stderr, foreign.stderr
    # On this host, its pid no longer runs: the next job takes it over with a notice and completes.
    owner.write_text(stale)
    restart = run_train([*PACED, "--max-steps", "4", "--run-dir", str(held)], env=env)
    assert restart.returncode == 0, restart.stderr[-3000:]
    took_over = _lines_with(restart.stderr, "took over the stale run lock")
    assert len(took_over) == 1 and f"pid {holder.pid}" in took_over[0], restart.stderr
    assert "start: fresh run" in _start_line(restart.stdout)
    assert not owner.exists()
