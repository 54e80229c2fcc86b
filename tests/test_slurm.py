"""The sbatch templates against real Slurm daemons (slurm/local_cluster.py), as a user submits them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddp_amp.checkpoint import verify_checkpoint
from tests.multiproc import REPO_ROOT, is_running, run_train
from tests.slurm_cluster import FINAL_STATES, Cluster, job_info, job_output, sbatch, wait_job

TINY = ["--task", "mlp", "--device", "cpu", "--max-steps", "20", "--log-every", "10", "--task-opt", "hidden=32",
        "--task-opt", "samples=1024"]


def _summary(cwd: Path, job_id: str) -> dict:
    path = cwd / "runs" / f"mlp-{job_id}" / "summary.json"
    assert path.exists(), job_output(cwd)
    return json.loads(path.read_text())


def _final_weights(run_dir: Path) -> dict:
    from ddp_amp.checkpoint.discovery import checkpoint_root, list_step_dirs
    from ddp_amp.checkpoint.layout import module_file

    _, newest = list_step_dirs(checkpoint_root(run_dir))[-1]
    return torch.load(newest / module_file("model"), weights_only=True)


def _records(job_dir: Path, job: str, task: str = "mlp") -> list[dict]:
    metrics = job_dir / "runs" / f"{task}-{job}" / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _requeued(job_dir: Path, job: str, task: str = "mlp") -> list[tuple[int, bool]]:
    """(step, requeued) of each `requeue` record: what `scontrol requeue` answered after a stop."""
    return [(r["step"], r["requeued"]) for r in _records(job_dir, job, task) if r.get("event") == "requeue"]


def _wait_until(condition, what: str, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


def _preemptible(max_steps: int) -> list[str]:
    """The tiny mlp run with `max_steps`, logging every 25 steps and checking signals every 0.2 s."""
    return [*TINY[:TINY.index("--max-steps")], *TINY[TINY.index("--task-opt"):], "--max-steps", str(max_steps),
            "--log-every", "25", "--preempt-check-s", "0.2"]


# Long enough that a stop lands mid-run on a fast idle machine (a signal takes well under a
# second to reach the ranks, about 300 steps there), short enough that the rest after the
# last stop, and the reference run beside the job, cost little.
PREEMPTIBLE_STEPS = 1000
PREEMPTIBLE = _preemptible(PREEMPTIBLE_STEPS)


def _job_beside_reference(cluster: Cluster, tmp_path: Path, args: list[str]) -> tuple[Path, str, Future]:
    """`args` as a 2-task job of the one-node template in tmp_path/job and, at the same time
    (a thread), as an uninterrupted 2-rank run in tmp_path/reference; returns (job dir, job
    id, the reference run's future)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job = sbatch(cluster, REPO_ROOT / "slurm" / "one_node.sbatch", ["--gpus-per-node=0", "--ntasks-per-node=2"],
                 args, job_dir)
    pool = ThreadPoolExecutor(1)
    reference = pool.submit(run_train, [*args, "--run-dir", str(tmp_path / "reference")], nproc=2, timeout=300)
    pool.shutdown(wait=False)  # the run goes on; the test waits for its result at the end
    return job_dir, job, reference


def test_a_job_preempted_twice_resumes_bitwise(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """USR1 via scancel, before and again after the first requeue: each is an agreed stop,
    a checkpoint and `scontrol requeue`; each requeued job (SLURM_RESTART_COUNT 1, then 2)
    resumes, and the job ends with the weights of an uninterrupted run."""
    job_dir, job, reference = _job_beside_reference(slurm_cluster, tmp_path, PREEMPTIBLE)
    for round_ in (1, 2):
        def training() -> bool:
            records = _records(job_dir, job)
            stops = [r["step"] for r in records if r.get("event") == "preempted"]
            logged = [r["step"] for r in records if "loss" in r]
            return len(stops) == round_ - 1 and bool(logged) and (not stops or max(logged) > stops[-1])

        _wait_until(training, f"training in round {round_}")
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm_cluster.env(), check=True, timeout=30)
        _wait_until(lambda: sum(r.get("event") == "preempted" for r in _records(job_dir, job)) == round_,
                    f"preemption {round_}")
    info = wait_job(slurm_cluster, job, timeout=300)
    out = job_output(job_dir)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", out
    # --open-mode=append kept every window's log; each stop says why and requeues.
    assert all(f"restart {n}" in out for n in (0, 1, 2)), out
    assert "after SIGUSR1" in out and f"requeued SLURM job {job}" in out, out
    assert f"resumed from runs/mlp-{job}/checkpoints/step-" in out, out
    stops = [r for r in _records(job_dir, job) if r.get("event") == "preempted"]
    assert [(r["action"], r["requeuing"]) for r in stops] == [("requeue", True), ("requeue", True)], stops
    assert _requeued(job_dir, job) == [(r["step"], True) for r in stops]
    assert stops[0]["step"] < stops[1]["step"] < PREEMPTIBLE_STEPS
    assert info["ExitCode"] == "0:0" and "srun --kill-on-bad-exit=1" in out, out  # the template prints its command
    summary = _summary(job_dir, job)
    assert summary["steps"] == PREEMPTIBLE_STEPS and summary["world_size"] == 2
    # The run directory is named after the job id, so each requeued window found it again.
    config = json.loads((job_dir / "runs" / f"mlp-{job}" / "config.json").read_text())
    assert config["env"]["launcher"] == "slurm" and config["env"]["run_id"] == job
    assert reference.result().returncode == 0, reference.result().stderr
    straight, resumed = _final_weights(tmp_path / "reference"), _final_weights(job_dir / "runs" / f"mlp-{job}")
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_scancel_cancels_a_requeue_job_after_its_checkpoint(slurm_cluster: Cluster, tmp_path: Path) -> None:
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "one_node.sbatch",
                 ["--gpus-per-node=0", "--ntasks-per-node=2"], _preemptible(100000), tmp_path)
    _wait_until(lambda: any("loss" in r for r in _records(tmp_path, job)), "training")
    subprocess.run(["scancel", job], env=slurm_cluster.env(), check=True, timeout=30)  # plain: SIGTERM
    info = wait_job(slurm_cluster, job, timeout=120)
    time.sleep(8)  # a requeue would have brought it back by now (cred_expire=5)
    info = job_info(slurm_cluster, job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, job_output(tmp_path))
    stops = [r for r in _records(tmp_path, job) if r.get("event") == "preempted"]
    assert len(stops) == 1 and stops[0]["action"] == "stop" and not stops[0]["requeuing"], stops
    verify_checkpoint(Path(tmp_path) / stops[0]["checkpoint"])
    # The line is out before any rank can end (srun --kill-on-bad-exit then kills the rest).
    assert (f"stopped at step {stops[0]['step']} after SIGTERM; checkpoint: {stops[0]['checkpoint']}; "
            "SIGTERM means stop: not requeued") in job_output(tmp_path)
    assert _requeued(tmp_path, job) == []


def test_multi_node_template_preempted_stops_quietly(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """Two emulated nodes, one torchrun each, one world: USR1 stops, checkpoints and
    requeues with one stop line, no launcher traceback, and a preempted record; the
    requeued job completes."""
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "multi_node.sbatch", ["--gpus-per-node=0", "--nodes=2"],
                 _preemptible(PREEMPTIBLE_STEPS), tmp_path, NPROC_PER_NODE="1")
    _wait_until(lambda: any("loss" in r for r in _records(tmp_path, job)), "training")
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_cluster.env(), check=True, timeout=30)
    info = wait_job(slurm_cluster, job, timeout=300)
    out = job_output(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert sum("stopped at step" in line for line in out.splitlines()) == 1, out
    stops = [r for r in _records(tmp_path, job) if r.get("event") == "preempted"]
    assert len(stops) == 1 and stops[0]["requeuing"] and _requeued(tmp_path, job) == [(stops[0]["step"], True)], stops
    assert info["NumNodes"] == "2"  # one torchrun per node, one world of two
    summary = _summary(tmp_path, job)
    assert summary["world_size"] == 2 and summary["steps"] == PREEMPTIBLE_STEPS
    config = json.loads((tmp_path / "runs" / f"mlp-{job}" / "config.json").read_text())
    assert config["env"]["launcher"] == "torchrun"


def _wait_in_job(cluster: Cluster, job: str, job_dir: Path, condition, what: str,  # type: ignore[no-untyped-def]
                 timeout: float = 120) -> None:
    """`_wait_until`, failing at once where the job ended first (it was not requeued, say)."""
    deadline, next_look = time.monotonic() + timeout, 0.0
    while not condition():
        now = time.monotonic()
        assert now < deadline, f"never saw {what}:\n{job_output(job_dir)}"
        if now >= next_look:
            state = job_info(cluster, job).get("JobState")
            if state in FINAL_STATES and not condition():
                raise AssertionError(f"job {job} ended ({state}) before {what}:\n{job_output(job_dir)}")
            next_look = now + 1
        time.sleep(0.05)


def _preempt(cluster: Cluster, job: str, job_dir: Path, round_: int) -> None:
    """Wait for training after the `round_ - 1` stops so far, send USR1, wait for stop `round_`."""
    def training() -> bool:
        records = _records(job_dir, job)
        stops = [r["step"] for r in records if r.get("event") == "preempted"]
        logged = [r["step"] for r in records if "loss" in r]
        return len(stops) == round_ - 1 and bool(logged) and (not stops or max(logged) > stops[-1])

    _wait_in_job(cluster, job, job_dir, training, f"training in round {round_}")
    subprocess.run(["scancel", "--signal=USR1", job], env=cluster.env(), check=True, timeout=30)
    _wait_in_job(cluster, job, job_dir,
                 lambda: sum(r.get("event") == "preempted" for r in _records(job_dir, job)) == round_,
                 f"preemption {round_}")


def test_a_job_requeued_max_requeues_times_is_not_requeued_again(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """--max-requeues 2 and three USR1 preemptions in one job's life: the first two each
    checkpoint, print their stop line, then requeue, and the job restarts (RestartCnt 1, 2)
    and resumes from that checkpoint; the third checkpoints and is not requeued: the job
    ends with exit code 75 after two restarts and its output says why."""
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "one_node.sbatch", ["--gpus-per-node=0", "--ntasks-per-node=2"],
                 [*_preemptible(100000), "--max-requeues", "2"], tmp_path)
    for round_ in (1, 2, 3):
        _preempt(slurm_cluster, job, tmp_path, round_)
    info = wait_job(slurm_cluster, job, timeout=120)
    out = job_output(tmp_path)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("FAILED", "2", "75:0"), (info, out)
    stops = [r for r in _records(tmp_path, job) if r.get("event") == "preempted"]
    assert [(r["signal"], r["action"], r["requeuing"]) for r in stops] == \
        [("SIGUSR1", "requeue", True)] * 2 + [("SIGUSR1", "requeue", False)], stops
    assert all(r["checkpoint"] for r in stops) and stops[0]["step"] < stops[1]["step"] < stops[2]["step"], stops
    assert _requeued(tmp_path, job) == [(stops[0]["step"], True), (stops[1]["step"], True)], out
    # Each stop's line reached the job's output, the two requeued ones said so before asking.
    nexts = [f"requeuing SLURM job {job}"] * 2 + [
        "not requeued: this job was requeued 2 times already (--max-requeues 2); resubmit it to go on"]
    for record, next_ in zip(stops, nexts):
        said = f"stopped at step {record['step']} after SIGUSR1; checkpoint: {record['checkpoint']}; {next_}"
        assert said in out, out
    # Said before asking: the requeue ends the step, and rank 0's answer comes after it.
    lines = out.splitlines()
    asked = [n for n, line in enumerate(lines) if line.endswith(f"; requeuing SLURM job {job}")]
    answered = [n for n, line in enumerate(lines) if f"] requeued SLURM job {job}; it resumes" in line]
    assert len(asked) == len(answered) == 2 and asked[0] < answered[0] < asked[1] < answered[1], out
    # Each requeued window resumed where the one before stopped; none came after the third stop.
    assert [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)] == [r["step"] for r in stops[:2]], out
    assert f"job {job} restart 2 " in out and f"job {job} restart 3 " not in out, out


def test_a_preemption_whose_checkpoint_failed_is_not_requeued(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """USR1 once the run's checkpoint directory is immutable (chattr +i: root ignores file
    modes, not that), so the preemption's save fails for real: the stop says the job is not
    requeued, and the job ends FAILED with the checkpoint error's exit code 3, never restarted."""
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "one_node.sbatch", ["--gpus-per-node=0", "--ntasks-per-node=2"],
                 _preemptible(100000), tmp_path)
    checkpoints = tmp_path / "runs" / f"mlp-{job}" / "checkpoints"
    _wait_in_job(slurm_cluster, job, tmp_path, lambda: any("loss" in r for r in _records(tmp_path, job)), "training")
    subprocess.run(["chattr", "+i", str(checkpoints)], check=True, timeout=30)
    try:
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm_cluster.env(), check=True, timeout=30)
        info = wait_job(slurm_cluster, job, timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(checkpoints)], check=True, timeout=30)
    out = job_output(tmp_path)
    # A requeue is asked before the process ends, and a requeued job is never FAILED.
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("FAILED", "0", "3:0"), (info, out)
    stops = [r for r in _records(tmp_path, job) if r.get("event") == "preempted"]
    assert len(stops) == 1 and stops[0]["checkpoint"] is None and not stops[0]["requeuing"], stops
    assert _requeued(tmp_path, job) == [] and not list(checkpoints.iterdir()), out
    assert (f"stopped at step {stops[0]['step']} after SIGUSR1; checkpoint: none; the checkpoint failed, "
            "so the job is not requeued") in out, out
    assert f"job {job} restart 1 " not in out, out


def _job_processes(job: str, command: str) -> list[int]:
    """The pids of this host's processes of `job` whose command line holds `command`."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"SLURM_JOB_ID={job}\0".encode() in environ.read_bytes() and \
                    command.encode() in (environ.parent / "cmdline").read_bytes().replace(b"\0", b" "):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def test_srun_killed_with_sigkill_takes_its_tasks_and_a_rerun_resumes(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """No orphans under srun: `kill -9` of srun gives it no chance to signal anything, yet
    Slurm ends the step's tasks (srun's helper process, its child, cancels the step), while
    the batch script goes on; the run lock goes with rank 0, and a rerun resumes from the
    last committed checkpoint. (Killing srun and its helper together leaves the tasks
    running: docs/facts.md.)"""
    script = tmp_path / "srun_then_wait.sh"
    script.write_text('#!/bin/bash\nsrun --kill-on-bad-exit=1 "$PYTHON" -m ddp_amp.train "$@"\n'
                      'echo "srun ended: $?"\nsleep 120\n')
    run_dir = tmp_path / "run"
    args = [*_preemptible(100000), "--ckpt-every", "50", "--run-dir", str(run_dir)]
    job = sbatch(slurm_cluster, script, ["--ntasks=2", "--nodes=1"], args, tmp_path)
    try:
        _wait_until(lambda: (run_dir / "checkpoints" / "step-00000100").exists(), "the checkpoint at step 100")
        srun_or_task = _job_processes(job, "-m ddp_amp.train")
        sruns = [pid for pid in srun_or_task if Path(f"/proc/{pid}/comm").read_text().strip() == "srun"]
        tasks = [pid for pid in srun_or_task if pid not in sruns]
        srun = [pid for pid in sruns if int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
                not in sruns]  # the one the batch script started, not its helper
        assert len(srun) == 1 and len(tasks) == 2, (sruns, tasks)
        os.kill(srun[0], signal.SIGKILL)
        killed = time.monotonic()
        _wait_until(lambda: not any(is_running(pid) for pid in tasks), "the tasks ending", timeout=30)
        ended_after = time.monotonic() - killed
        _wait_until(lambda: "srun ended: 137" in job_output(tmp_path), "the batch script going on", timeout=30)
        assert job_info(slurm_cluster, job)["JobState"] == "RUNNING"  # the allocation is still there
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster.env(), timeout=30)
    from ddp_amp.checkpoint.discovery import checkpoint_root, list_step_dirs

    step, newest = list_step_dirs(checkpoint_root(run_dir))[-1]
    rerun = run_train([*_preemptible(step + 10), "--run-dir", str(run_dir), "--resume", "auto"], nproc=2)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"start: resume from {newest}" in rerun.stdout, rerun.stdout
    print(f"the tasks ended {ended_after:.2f} s after srun was killed")


def test_a_rank_hung_with_the_gil_held_under_plain_srun_ends_and_the_job_with_it(slurm_cluster: Cluster,
                                                                                  tmp_path: Path) -> None:
    """A user's own batch script: plain `srun`, no --kill-on-bad-exit. Rank 1 hangs in one C
    call that keeps the GIL (none of its threads can run); rank 0, which hosts the store,
    names it and exits. Rank 1's heartbeat helper ends it, so the job ends instead of running
    on to its time limit."""
    script = tmp_path / "plain_srun.sh"
    script.write_text('#!/bin/bash\nsrun "$PYTHON" -m ddp_amp.train "$@"\necho "srun ended: $?"\n')
    args = ["--task", "tests.plugins.ckpt_task:make_task", "--batch-size", "8", "--device", "cpu", "--log-every",
            "1000", "--max-steps", "100000", "--run-dir", str(tmp_path / "run"), "--task-opt", "gil_at=5",
            "--task-opt", "kill_rank=1", "--dist-timeout", "5"]
    job = sbatch(slurm_cluster, script, ["--ntasks=2", "--nodes=1", "--time=10"], args, tmp_path)
    try:
        info = wait_job(slurm_cluster, job, timeout=240)
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster.env(), timeout=30)
    output = job_output(tmp_path)
    assert info.get("JobState") in FINAL_STATES - {"TIMEOUT", "CANCELLED"}, (info, output[-3000:])
    assert "srun ended: " in output and "srun ended: 0" not in output, output[-3000:]
    ours = [line for line in output.splitlines() if line.startswith("ddp_amp: ")]
    assert ours == ["ddp_amp: rank 1 made no progress since step 5: alive, but never joined the collective that "
                    "timed out (--dist-timeout) on the others (a hang in its own code or I/O: data loading, a file "
                    "system, a deadlock); the other ranks reached step 5"], output[-3000:]


@pytest.fixture(scope="module", autouse=True)
def time_limited_job(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The time-limited job of the last test, submitted before this module's first test: its
    windows are set by slurmctld's clock (about 80 s of mostly waiting), so it runs beside the
    other tests' jobs (the nodes declare far more CPUs than the jobs ask for)."""
    tmp_path = tmp_path_factory.mktemp("time_limited")
    steps = 2000  # x 20 ms per step
    args = ["--task", "tests.plugins.paced_task:make_task", "--device", "cpu", "--max-steps", str(steps),
            "--log-every", "100", "--preempt-check-s", "0.2"]
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "one_node.sbatch",
                 ["--gpus-per-node=0", "--ntasks-per-node=2", "--time=1", "--signal=USR1@50"], args, tmp_path)
    yield job, tmp_path
    subprocess.run(["scancel", job], env=slurm_cluster.env(), timeout=30)  # where the test did not run


def test_a_time_limited_job_finishes_over_several_windows(slurm_cluster: Cluster,
                                                           time_limited_job: tuple[str, Path]) -> None:
    """`--time=1` and the template's USR1 warning, 50 s ahead of the limit, for work of about
    40 s of steps: each warning checkpoints and requeues, every window starts at the step the
    last one stopped at (no step is lost or done twice), and the job ends COMPLETED, not TIMEOUT.

    slurmctld checks time limits every 30 s, so the warning lands 10-40 s into a window and
    the work always needs a second one."""
    job, tmp_path = time_limited_job
    steps = 2000
    info = wait_job(slurm_cluster, job, timeout=480)
    out = job_output(tmp_path)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (info, out)
    stops = [r for r in _records(tmp_path, job, task="paced_task") if r.get("event") == "preempted"]
    assert len(stops) == int(info["Restarts"]), (stops, out)
    assert all(r["signal"] == "SIGUSR1" and r["action"] == "requeue" and r["requeuing"] for r in stops), stops
    assert _requeued(tmp_path, job, task="paced_task") == [(r["step"], True) for r in stops]
    resumed_at = [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert resumed_at == [r["step"] for r in stops], out
    summary = json.loads((tmp_path / "runs" / f"paced_task-{job}" / "summary.json").read_text())
    assert summary["steps"] == steps
    # The summary's rate is of this window's own samples, not of every window's over its time.
    logged = [r["samples_per_s"] for r in _records(tmp_path, job, task="paced_task") if "loss" in r]
    assert summary["samples_per_s"] < 1.5 * max(logged), (summary, logged)
