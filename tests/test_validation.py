"""Every value a user supplies is checked at the edge: one line, exit 2, nothing created."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddp_amp.config import TrainConfig, flag_of
from ddp_amp.command_line import parse_command_line
from ddp_amp.errors import UsageError
from ddp_amp.train import main
from tests.multiproc import run_train

NUMERIC = [f.name for f in dataclasses.fields(TrainConfig) if str(f.type) in ("int", "float")]
# Zero is a documented value of these (their --help says what 0 means).
ZERO_IS_VALID = {"lr", "clip_grad_norm", "seed", "num_workers", "ckpt_every", "keep_last", "eval_every",
                 "max_consecutive_skips", "check_sync_every", "loss_scale_min", "max_requeues", "peak_tflops"}


def test_the_table_covers_every_numeric_option() -> None:
    assert len(NUMERIC) == 28 and "loss_scale_init" in NUMERIC and "preempt_check_s" in NUMERIC
    assert {"peer_poll", "peer_silence", "replicate", "tensor_parallel", "context_parallel",
            "peer_beats_per_s"} <= set(NUMERIC)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "0", "1e30", str(10**30)])
@pytest.mark.parametrize("name", NUMERIC)
def test_numeric_option_is_refused_in_one_line_or_means_what_help_says(name: str, raw: str) -> None:
    flag = flag_of(name)
    try:
        config = parse_command_line([f"{flag}={raw}"]).config
    except UsageError as error:
        assert "\n" not in str(error) and str(error).startswith(flag), str(error)
        return
    assert raw == "0" and name in ZERO_IS_VALID, f"{flag} {raw} was accepted"
    assert getattr(config, name) == 0


@pytest.mark.parametrize("argv, expected", [
    (["--lr", "nan"], "--lr=nan: expected a finite number"),
    (["--dist-timeout", "inf"], "--dist-timeout=inf"),
    (["--loss-scale-init", "inf"], "--loss-scale-init=inf"),
    (["--preempt-check-s", "nan"], "--preempt-check-s=nan"),
    (["--task", "tests.plugins.wrong_tasks:empty_train_set"], "a non-empty Task.train_data"),
    (["--task", "tests.plugins.wrong_tasks:empty_eval_set"], "a non-empty Task.eval_data, or None"),
    (["--task", "lm", "--task-opt", "bptt=5000"], "--task-opt bptt=5000: expected at most 4096"),
    (["--task", "lm", "--task-opt", "dropout=nan"], "--task-opt dropout='nan': expected a finite number"),
])
def test_bad_values_exit_2_with_one_line_and_create_nothing(
        argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main([*argv, "--device", "cpu"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_amp: error: ") and expected in lines[0], lines
    assert out.out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
def test_namedtuple_and_dataclass_batches_reach_the_model_field_by_field(kind: str, tmp_path: Path) -> None:
    result = run_train(["--task", "tests.plugins.structured_task:make_task", "--task-opt", f"batch={kind}",
                        "--device", "cpu", "--max-steps", "6", "--batch-size", "8", "--eval-every", "3",
                        "--run-dir", str(tmp_path)], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval_mse=" in result.stdout
