"""`python -m ddp_amp.doctor`: the resolved launch, the classic mistakes, and the probe."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from ddp_amp.doctor import check_gpus, diagnose
from ddp_amp.env import DistEnv
from tests.multiproc import REPO_ROOT, cli_env, free_port
from tests.slurm_cluster import Cluster, job_output, sbatch, wait_job

TORCHRUN_RANK0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1"}


def _levels(findings: list[tuple[str, str]], level: str) -> str:
    return " | ".join(message for lvl, message in findings if lvl == level)


def test_single_process_reports_launcher_device_and_auto_precision() -> None:
    env, facts, findings = diagnose({})
    import torch

    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert env is not None and facts["launcher"] == "single" and facts["device"].startswith(expected_device)
    assert facts["precision_auto"].startswith(("fp32", "bf16", "fp16"))
    if expected_device == "cpu":  # a CPU has no float8 matmuls: the doctor says so, and why
        assert facts["precision_fp8"].startswith("not available:")
        assert "8.9" in facts["precision_fp8"] or "torchao" in facts["precision_fp8"]
    assert facts["shard"] == "available: one process: --shard runs, with nothing to shard over"
    assert not _levels(findings, "error")


def test_port_in_use_is_an_error_and_a_free_port_is_ok() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        _, _, findings = diagnose({**TORCHRUN_RANK0, "MASTER_PORT": str(port)})
        assert f"MASTER_PORT {port} is in use" in _levels(findings, "error")
    _, _, findings = diagnose({**TORCHRUN_RANK0, "MASTER_PORT": str(free_port())})
    # (On a machine with one GPU the 2-process world is also flagged: not this test's concern.)
    assert "is free" in _levels(findings, "ok") and "MASTER_PORT" not in _levels(findings, "error")


def test_unresolvable_master_addr_and_partial_env_are_errors() -> None:
    _, _, findings = diagnose({**TORCHRUN_RANK0, "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"})
    assert "does not resolve" in _levels(findings, "error")
    env, _, findings = diagnose({"RANK": "1", "WORLD_SIZE": "2"})
    assert env is None and "MASTER_ADDR" in _levels(findings, "error")


def test_tasks_per_node_must_match_gpus() -> None:
    eight = DistEnv(rank=5, local_rank=5, world_size=8, local_world_size=8, launcher="slurm")
    assert check_gpus(eight, {}, 4)[0][0] == "error" and "--ntasks-per-node=4" in check_gpus(eight, {}, 4)[0][1]
    two = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, launcher="torchrun")
    assert check_gpus(two, {}, 4)[0][0] == "warn" and "--nproc-per-node=4" in check_gpus(two, {}, 4)[0][1]
    assert check_gpus(two, {}, 2)[0][0] == "ok"
    assert check_gpus(two, {"CUDA_VISIBLE_DEVICES": "1"}, 1)[0][0] == "ok"  # srun --gpus-per-task=1


def test_probe_under_torchrun_reports_latency_and_bandwidth() -> None:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "ddp_amp.doctor", "--probe", "--probe-mb", "1", "--iters", "5"],
                            capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "ddp_amp doctor rank 1:" in result.stdout and "launcher          torchrun" in result.stdout
    assert "probe: all-reduce over 2 ranks (gloo): latency" in result.stdout, result.stdout
    assert "shard             available: each of 2 ranks holds 1/2 of the parameters" in result.stdout


def test_on_slurm_the_batch_shell_is_flagged_and_srun_tasks_probe(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """Verified against real daemons: the batch shell has SLURM_PROCID but no step; srun has both."""
    script = tmp_path / "doctor.sbatch"
    script.write_text("#!/bin/bash\n"
                      "\"$PYTHON\" -m ddp_amp.doctor; echo \"batch-shell-exit=$?\"\n"
                      "srun \"$PYTHON\" -m ddp_amp.doctor --probe --probe-mb 1 --iters 5\n")
    job = sbatch(slurm_cluster, script, ["--ntasks=2", "--nodes=1"], [], tmp_path)
    info = wait_job(slurm_cluster, job)
    out = job_output(tmp_path)
    assert info["JobState"] == "COMPLETED", out
    assert "but not started by srun" in out and "batch-shell-exit=1" in out
    assert "launcher          slurm" in out and "probe: all-reduce over 2 ranks (gloo)" in out, out


def test_doctor_says_what_each_signal_does() -> None:
    _, facts, _ = diagnose({})
    assert facts["signals"] == ("USR1: checkpoint + requeue, exit 75 (--preempt-signal); "
                                "TERM: checkpoint + stop, no requeue, exit 128+N (--stop-signal)")
