"""`--profile-steps A:B` and `--memory-snapshot` refuse what they cannot do, in one line (the
window itself is recorded in tests/test_trackers.py's two-rank run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_amp import UsageError
from ddp_amp.command_line import parse_command_line
from ddp_amp.option_values import StepWindow
from ddp_amp.trainer import build_trainer, session_for


@pytest.mark.parametrize("window", ["3", "0:2", "5:4", "a:b", "2:3:4"])
def test_a_window_must_be_steps_a_to_b(window: str) -> None:
    with pytest.raises(UsageError, match=r"--profile-steps='.*': expected A:B with 1 <= A <= B"):
        _ = parse_command_line(["--profile-steps", window]).config
    assert parse_command_line(["--profile-steps", "2:2"]).config.profile_steps == StepWindow(2, 2)


def test_a_memory_snapshot_needs_a_cuda_device() -> None:
    config = parse_command_line(["--task", "mlp", "--device", "cpu", "--memory-snapshot",
                                 "--task-opt", "samples=256"]).config
    with pytest.raises(UsageError, match="--memory-snapshot=True: expected a CUDA device"):
        with session_for(config) as session:
            build_trainer(session, config)


@pytest.mark.cuda
def test_on_a_gpu_the_window_records_device_time_and_a_memory_snapshot(tmp_path: Path) -> None:
    from tests.multiproc import cli_env, run_train

    result = run_train(["--task", "mlp", "--max-steps", "4", "--profile-steps", "2:3", "--memory-snapshot",
                        "--run-dir", str(tmp_path)], env=cli_env(gpus=True), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "device ms" in result.stdout and (tmp_path / "profile" / "memory-rank0.pickle").stat().st_size > 0
    assert len(list((tmp_path / "profile").glob("rank0.*.pt.trace.json"))) == 1
