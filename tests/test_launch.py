"""launch/: the thin launchers print their command and start real jobs; multi-node on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import REPO_ROOT, cli_env, free_port

TINY = ["--task", "mlp", "--device", "cpu", "--max-steps", "20", "--log-every", "10", "--task-opt", "hidden=32",
        "--task-opt", "samples=1024"]


def _env(**extra: str) -> dict[str, str]:
    env = cli_env(PYTHON=sys.executable, **extra)
    return env


def test_local_launcher_prints_and_runs_one_cpu_process(tmp_path: Path) -> None:
    result = subprocess.run([str(REPO_ROOT / "launch" / "local.sh"), *TINY, "--run-dir", str(tmp_path)],
                            capture_output=True, text=True, env=_env(NPROC="0"), cwd=REPO_ROOT, timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"+ {sys.executable} -m ddp_amp.train --task mlp --device cpu" in result.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 1


def test_two_torchrun_agents_on_loopback_form_one_world(tmp_path: Path) -> None:
    """Multi-node without SLURM: two 'nodes' (agents) x 1 process meet by c10d rendezvous."""
    port = str(free_port())
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NNODES="2", NPROC_PER_NODE="1",
               RUN_ID="loopback")
    command = [str(REPO_ROOT / "launch" / "multinode.sh"), *TINY, "--run-dir", str(tmp_path)]
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=REPO_ROOT) for _ in range(2)]
    outputs = [agent.communicate(timeout=240) for agent in agents]
    for agent, (_, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr
    assert f"--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port}" in outputs[0][1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["env"]["local_world_size"] == 1  # two nodes of one process, not one of two


def _what_the_rank_sees(ctx: object, name: str) -> tuple[str | None, str, int]:
    import os

    print(f"rank output {os.environ.get(name)}", flush=True)
    return os.environ.get(name), os.getcwd(), os.getpid()


@pytest.fixture(scope="module")
def started_fork_server() -> None:
    """A first call, outside the test below and its captured output: the fork server starts here."""
    from tests.multiproc import run_ranks

    run_ranks(_what_the_rank_sees, 1, "DDP_AMP_TEST_MARK")


def test_run_ranks_children_get_the_callers_current_environment_directory_and_output(
        started_fork_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Children fork from a server started at the first call: each must still see what the
    caller has now, not what it had then."""
    import os

    from tests.multiproc import run_ranks

    monkeypatch.setenv("DDP_AMP_TEST_MARK", "second")
    monkeypatch.chdir(tmp_path)
    seen = run_ranks(_what_the_rank_sees, 2, "DDP_AMP_TEST_MARK")
    assert [(value, cwd) for value, cwd, _ in seen] == [("second", str(tmp_path))] * 2
    assert len({pid for _, _, pid in seen} | {os.getpid()}) == 3  # processes of their own
    assert capfd.readouterr().out.count("rank output second") == 2
