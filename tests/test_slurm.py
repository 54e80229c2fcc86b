"""The sbatch templates against real Slurm daemons (slurm/local_cluster.py), as a user submits them."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.multiproc import REPO_ROOT, run_train
from tests.slurm_cluster import Cluster, job_output, sbatch, wait_job

TINY = ["--task", "mlp", "--device", "cpu", "--max-steps", "20", "--log-every", "10", "--task-opt", "hidden=32",
        "--task-opt", "samples=1024"]


def _summary(cwd: Path, job_id: str) -> dict:
    path = cwd / "runs" / f"mlp-{job_id}" / "summary.json"
    assert path.exists(), job_output(cwd)
    return json.loads(path.read_text())


def test_one_node_template_trains_two_tasks(slurm_cluster: Cluster, tmp_path: Path) -> None:
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "one_node.sbatch",
                 ["--gpus-per-node=0", "--ntasks-per-node=2"], TINY, tmp_path)
    info = wait_job(slurm_cluster, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job_output(tmp_path)
    summary = _summary(tmp_path, job)
    assert summary["world_size"] == 2 and summary["steps"] == 20
    # The run directory is named after the job id, so a requeued job finds it again.
    config = json.loads((tmp_path / "runs" / f"mlp-{job}" / "config.json").read_text())
    assert config["env"]["launcher"] == "slurm" and config["env"]["run_id"] == job
    assert "srun --kill-on-bad-exit=1" in job_output(tmp_path)  # the template prints its command


def test_multi_node_template_spans_two_nodes(slurm_cluster: Cluster, tmp_path: Path) -> None:
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "multi_node.sbatch",
                 ["--gpus-per-node=0", "--nodes=2"], TINY, tmp_path, NPROC_PER_NODE="1")
    info = wait_job(slurm_cluster, job)
    assert info["JobState"] == "COMPLETED", job_output(tmp_path)
    assert info["NumNodes"] == "2"
    summary = _summary(tmp_path, job)
    assert summary["world_size"] == 2
    config = json.loads((tmp_path / "runs" / f"mlp-{job}" / "config.json").read_text())
    assert config["env"]["launcher"] == "torchrun"


def _final_weights(run_dir: Path) -> dict:
    from ddp_amp.checkpoint.discovery import checkpoint_root, list_step_dirs
    from ddp_amp.trainer.checkpointing import MODEL_FILE

    _, newest = list_step_dirs(checkpoint_root(run_dir))[-1]
    return torch.load(newest / MODEL_FILE, weights_only=True)


def test_preempted_job_checkpoints_requeues_and_resumes_bitwise(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """USR1 via scancel -> agreed stop, checkpoint, `scontrol requeue`; the requeued job
    (SLURM_RESTART_COUNT=1) resumes and ends with the weights of an uninterrupted run."""
    pytest.importorskip("ddp_amp.checkpoint", reason="needs the checkpoint layer (branch ckpt)")
    steps = ["--max-steps", "1500", "--log-every", "25", "--preempt-check-s", "0.2"]
    args = [*TINY[:TINY.index("--max-steps")], *TINY[TINY.index("--task-opt"):], *steps]
    reference = run_train([*args, "--run-dir", str(tmp_path / "reference")], nproc=2, timeout=300)
    assert reference.returncode == 0, reference.stderr
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job = sbatch(slurm_cluster, REPO_ROOT / "slurm" / "one_node.sbatch",
                 ["--gpus-per-node=0", "--ntasks-per-node=2"], args, job_dir)
    metrics = job_dir / "runs" / f"mlp-{job}" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_cluster.env(), check=True, timeout=30)
    info = wait_job(slurm_cluster, job, timeout=240)
    out = job_output(job_dir)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert "restart 0" in out and "restart 1" in out  # --open-mode=append kept the first run's log
    assert "after SIGUSR1" in out and f"requeued SLURM job {job}" in out, out
    assert f"resumed from runs/mlp-{job}/checkpoints/step-" in out, out
    summary = _summary(job_dir, job)
    assert summary["steps"] == 1500 and summary["world_size"] == 2
    straight, resumed = _final_weights(tmp_path / "reference"), _final_weights(job_dir / "runs" / f"mlp-{job}")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
