"""An error on one rank ends every rank within seconds, printed once, naming the rank.

Two real gloo ranks under torchrun, with a task that fails on one rank only.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.multiproc import run_train

FAILING = ["--task", "tests.plugins.failing_task:make_task", "--device", "cpu", "--batch-size", "16",
           "--max-steps", "40", "--eval-every", "0", "--log-every", "100"]


@pytest.mark.parametrize("fail_at, error, code, line", [
    ("build", "usage", 2, "ddp_amp: error: --task-opt fail_at='build': expected a task that does not fail "
                          "(hint: planted failure in build on rank 1) (on rank 1)"),
    ("step", "runtime", 1, "ddp_amp: rank 1: RuntimeError: planted failure in step on rank 1"),
    ("step", "memory", 1, "ddp_amp: rank 1: MemoryError: out of memory (simulated): planted failure in step"),
    ("eval", "runtime", 1, "ddp_amp: rank 1: RuntimeError: planted failure in eval on rank 1"),
    ("checkpoint", "runtime", 2, "ddp_amp: error: checkpoint entry=\"model.pt['_extra_state']\""),
])
def test_one_rank_fails_and_every_rank_stops_within_seconds_with_one_message(
        tmp_path: Path, fail_at: str, error: str, code: int, line: str) -> None:
    args = [*FAILING, "--task-opt", f"fail_at={fail_at}", "--task-opt", f"error={error}", "--run-dir", str(tmp_path)]
    if fail_at == "eval":
        args += ["--eval-every", "5"]
    if fail_at == "checkpoint":
        args += ["--ckpt-every", "5"]
    started = time.monotonic()
    result = run_train(args, nproc=2, timeout=120)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0 and elapsed < 30, (result.returncode, elapsed, output[-3000:])
    ours = [text for text in output.splitlines() if text.startswith("ddp_amp: ")]
    assert len(ours) == 1 and ours[0].startswith(line), output[-3000:]
    assert f"exitcode: {code}" in result.stderr  # torchrun reports the failing rank's own code


@pytest.mark.parametrize("refused, line", [
    # refused where the run core starts (its precision), on every rank alike
    (["--precision", "fp8"], "ddp_amp: error: --precision='fp8': expected a GPU with float8 matmuls"),
    # refused while the Trainer is built, on every rank alike, after the group formed
    (["--memory-snapshot"], "ddp_amp: error: --memory-snapshot=True: expected a CUDA device"),
])
def test_a_refusal_every_rank_makes_is_printed_once(tmp_path: Path, refused: list[str], line: str) -> None:
    result = run_train([*FAILING, *refused, "--run-dir", str(tmp_path / "run")], nproc=2, timeout=120)
    ours = [text for text in (result.stdout + result.stderr).splitlines() if text.startswith("ddp_amp: ")]
    assert result.returncode != 0 and len(ours) == 1 and ours[0].startswith(line), result.stderr[-3000:]
