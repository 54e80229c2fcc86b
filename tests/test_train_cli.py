"""`python -m ddp_amp.train` and `torchrun -m ddp_amp.train` as users run them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_amp.config import TrainConfig, build_parser
from ddp_amp.train import main
from tests.multiproc import run_train


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_torchrun_two_ranks_trains_in_every_precision(precision: str, tmp_path: Path) -> None:
    # fp16 also runs with gradient compression: its overflow probe must wrap that DDP hook
    extra = ["--grad-comm-dtype", "bf16"] if precision == "fp16" else []
    result = run_train(["--task", "mlp", "--precision", precision, "--max-steps", "30", "--log-every", "10",
                        "--task-opt", "hidden=32", "--run-dir", str(tmp_path), *extra], nproc=2)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["precision"] == precision and summary["steps"] == 30
    assert "terminate called" not in result.stderr
    assert result.stdout.count("summary:") == 1  # rank 0 alone reports


@pytest.mark.parametrize(("args", "fragment"), [
    (["--precision", "fp8"], "--precision='fp8': expected one of auto, fp32, bf16, fp16"),
    (["--max-stpes", "3"], "did you mean --max-steps?"),
    (["--batch-size", "63", "--grad-accum", "2"], "--batch-size=63: expected a multiple of world size x --grad-accum"),
    (["--task", "no_such_module:make"], "--task='no_such_module:make': expected an importable module"),
    (["--task", "tests.plugins.wrong_tasks:returns_a_model"], "expected a function returning ddp_amp.Task, got Linear"),
    (["--task", "tests.plugins.wrong_tasks:model_is_not_a_module"], "Task.model to be a torch.nn.Module"),
    (["--task", "mlp", "--task-opt", "width"], "--task-opt='width': expected KEY=VALUE"),
    (["--max-steps", "ten"], "--max-steps='ten': expected a value of type int"),
    (["--device", "cuda"], "--device='cuda': expected a machine with a CUDA GPU"),
])
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], fragment: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU, so --device cuda is valid here")
    assert main(args + ["--run-dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "hint:" in lines[0], lines
    assert not (tmp_path / "run").exists()  # nothing written for a run that never started


def test_bad_input_from_real_processes_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    alone = run_train(["--precision", "fp8", "--run-dir", str(tmp_path)])
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1 and "Traceback" not in alone.stderr
    # Under torchrun both ranks reject the batch; rank 0 alone says so, torchrun exits non-zero.
    pair = run_train(["--batch-size", "3", "--run-dir", str(tmp_path)], nproc=2)
    assert pair.returncode != 0 and pair.stderr.count("ddp_amp: error: --batch-size=3") == 1


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run_train(["--precision", "fp8", "--debug", "--run-dir", str(tmp_path)])
    assert result.returncode != 0 and "Traceback" in result.stderr and "UsageError" in result.stderr


def test_every_option_has_help_text() -> None:
    parser = build_parser()
    options = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(options) == {f for f in TrainConfig.__dataclass_fields__}
    assert all(action.help and len(action.help) > 15 for action in options.values())
