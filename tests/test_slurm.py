"""The sbatch templates against real Slurm daemons (slurm/local_cluster.py), as a user submits them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multiproc import REPO_ROOT
from tests.slurm_cluster import Cluster, job_output, sbatch, wait_job

TINY = ["--device", "cpu", "--max-steps", "20", "--log-every", "10", "--task-opt", "hidden=32",
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
