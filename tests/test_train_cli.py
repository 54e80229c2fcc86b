"""`python -m ddp_amp.train` and `torchrun -m ddp_amp.train` as users run them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_amp.config import TrainConfig
from ddp_amp.command_line import build_parser, parse_command_line
from ddp_amp.errors import UsageError
from ddp_amp.train import main
from tests.multiproc import cli_env, run_train


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
    (["--precision", "fp4"], "--precision='fp4': expected one of auto, fp32, bf16, fp16, fp8"),
    (["--precision", "fp8"], "--precision='fp8': expected a GPU with float8 matmuls"),
    (["--max-stpes", "3"], "did you mean --max-steps?"),
    (["--batch-size", "63", "--grad-accum", "2"], "--batch-size=63: expected a multiple of world size x --grad-accum"),
    (["--task", "no_such_module:make"], "--task='no_such_module:make': expected an importable module"),
    (["--task", "tests.plugins.wrong_tasks:returns_a_model"], "expected a function returning ddp_amp.Task, got Linear"),
    (["--task", "tests.plugins.wrong_tasks:model_is_not_a_module"], "Task.model to be a torch.nn.Module"),
    (["--task", "tests.plugins.wrong_tasks:loss_fn_and_step_fn"], "expected Task.loss_fn or Task.step_fn, not both"),
    (["--task", "tests.plugins.wrong_tasks:schedule_on_plateau_without_metric_name"],
     "expected Task.schedule_on to be 'step', 'epoch' or 'eval:METRIC', got 'eval'"),
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


def test_one_process_with_a_named_backend_runs_ddp_in_a_group_of_one(tmp_path: Path) -> None:
    # Named: a group of one, so the DDP path runs (the way to check it, and NCCL, on one GPU).
    # DDP over one rank averages over 1, so the run must match the group-less one bit for bit.
    common = ["--task", "mlp", "--device", "cpu", "--precision", "fp16", "--max-steps", "6", "--log-every", "3"]
    summaries = {}
    for backend in ("auto", "gloo"):
        result = run_train([*common, "--backend", backend, "--run-dir", str(tmp_path / backend)])
        assert result.returncode == 0, result.stderr[-2000:]
        expected = "backend=none" if backend == "auto" else "backend=gloo"
        assert expected in result.stdout, result.stdout[:500]
        summaries[backend] = json.loads((tmp_path / backend / "summary.json").read_text())
    assert summaries["gloo"]["world_size"] == 1
    assert summaries["gloo"]["loss"] == summaries["auto"]["loss"]


@pytest.mark.cuda
def test_more_ranks_than_gpus_is_one_line_from_every_rank_not_a_hang(tmp_path: Path) -> None:
    import torch

    # One more rank than GPUs without --backend gloo: every rank of the node must fail alike,
    # so that rank 0 (the one that prints) does not wait for a peer that already left.
    ranks = torch.cuda.device_count() + 1
    result = run_train(["--task", "mlp", "--max-steps", "3", "--run-dir", str(tmp_path)], nproc=ranks,
                       timeout=120, env=cli_env(gpus=True))
    assert result.returncode != 0
    assert result.stderr.count(f"ddp_amp: error: LOCAL_WORLD_SIZE={ranks}: expected <= {ranks - 1} visible GPU") == 1
    assert "--backend gloo" in result.stderr and not (tmp_path / "summary.json").exists()


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run_train(["--precision", "fp8", "--debug", "--run-dir", str(tmp_path)])
    assert result.returncode != 0 and "Traceback" in result.stderr and "UsageError" in result.stderr


def test_every_option_has_help_text() -> None:
    parser = build_parser()
    options = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(options) == {f for f in TrainConfig.__dataclass_fields__}
    assert all(action.help and len(action.help) > 15 for action in options.values())


@pytest.mark.parametrize("argv, match", [
    (["--run-dir", "a", "--run-name", "b"], "either --run-dir or --run-name"),
    (["--run-name", "x/y"], "a plain name"),
    (["--archive-checkpoints"], "--resume none with it"),
    (["--allow-change", "lr"], "names of settings that must match on resume"),
])
def test_run_options_are_checked(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        _ = parse_command_line(argv).config


def test_allow_change_takes_flag_or_field_names() -> None:
    config = parse_command_line(["--allow-change=--task-opt,seed", "--optimizer", "sgd"]).config
    assert config.allow_change == ("task_opt", "seed")
    help_text = build_parser().format_help()
    assert "[must match on resume]" in help_text and "--allow-change" in help_text
