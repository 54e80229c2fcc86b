"""The real local Slurm cluster as a session fixture, and helpers to submit and wait for jobs.

`slurm_cluster` starts slurm/local_cluster.py with two emulated nodes once per session
(installing Debian's packages where missing) and stops it at the end. It skips only where
the machine cannot run it: not root, not Linux, or no Slurm and no apt-get.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.multiproc import REPO_ROOT, cli_env

CLUSTER_SCRIPT = REPO_ROOT / "slurm" / "local_cluster.py"
CLUSTER_DIR = Path(os.environ.get("DDP_AMP_SLURM_DIR", "/tmp/ddp_amp-slurm"))
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@dataclass(frozen=True)
class Cluster:
    conf: Path
    nodes: list[str]

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for sbatch/scontrol and the jobs (sbatch exports it to the job)."""
        env = cli_env(SLURM_CONF=str(self.conf), PYTHON=sys.executable, **extra)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env


def _skip_reason() -> str:
    if sys.platform != "linux":
        return "the local Slurm cluster needs Linux"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as any user, munged as munge)"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "Slurm is not installed and apt-get is not available to install it"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    command = [sys.executable, str(CLUSTER_SCRIPT), "--dir", str(CLUSTER_DIR)]
    started = subprocess.run([*command, "start", "--nodes", "2"], capture_output=True, text=True,
                             timeout=600)
    if started.returncode != 0:
        pytest.fail(f"local Slurm cluster did not start:\n{started.stdout}\n{started.stderr}")
    try:
        yield Cluster(CLUSTER_DIR / "slurm.conf", (CLUSTER_DIR / "nodes").read_text().split())
    finally:
        subprocess.run([*command, "stop"], capture_output=True, text=True, timeout=120)


def sbatch(cluster: Cluster, script: Path, sbatch_args: list[str], train_args: list[str],
           cwd: Path, **env: str) -> str:
    """Submit `script` like a user would; returns the job id."""
    result = subprocess.run(["sbatch", "--parsable", f"--chdir={cwd}", f"--output={cwd}/job.out",
                             *sbatch_args, str(script), *train_args],
                            capture_output=True, text=True, env=cluster.env(**env), timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"sbatch failed: {result.stderr}")
    return result.stdout.strip().split(";")[0]


def job_info(cluster: Cluster, job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (sacct needs accounting, which the cluster does not run)."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                            text=True, env=cluster.env(), timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def wait_job(cluster: Cluster, job_id: str, timeout: float = 150) -> dict[str, str]:
    """Poll until the job reaches a final state; returns its last `scontrol show job` record."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(cluster, job_id)
        if info.get("JobState") in FINAL_STATES:
            return info
        time.sleep(0.2)
    subprocess.run(["scancel", job_id], env=cluster.env(), timeout=30)
    raise TimeoutError(f"job {job_id} not done after {timeout}s: {info}")


def job_output(cwd: Path) -> str:
    path = cwd / "job.out"
    return path.read_text() if path.exists() else "(no job.out)"
