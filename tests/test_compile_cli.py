"""`--compile` through the CLI, as users run it: torchrun with 2 ranks, DDP and `--shard`.

Dynamo's own tally of the graphs it compiled (`compiled_graphs`, in each log record of a
compiled run) must be above 0 once the compiled code has run (the second step: the first is
counted for its FLOPs, eagerly), and must not grow on later steps of the same shapes (a
recompile per step). The run's FLOPs are still counted. The tiny `lm` task of the sharded
tests, with their shapes, so inductor's cache serves both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc import run_train
from tests.test_shard import LM_OPTIONS
from tests.test_shard_compile import _inductor_compiler
from tests.torch_features import needs_sharding

pytestmark = pytest.mark.skipif(_inductor_compiler() is None,
                                reason="inductor compiles CPU kernels with a C++ compiler (g++); none found")

STEPS = 4


def _step_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record for record in records if "loss" in record and "summary" not in record}


@pytest.mark.parametrize("mode", ["ddp", pytest.param("shard", marks=needs_sharding)])
def test_compile_compiles_through_the_cli_and_later_steps_do_not_recompile(mode: str, tmp_path: Path) -> None:
    run_dir = tmp_path / mode
    args = ["--task", "lm", *(arg for option in LM_OPTIONS for arg in ("--task-opt", option)),
            "--compile", "--max-steps", str(STEPS), "--log-every", "1", "--eval-every", "0", "--grad-accum", "2",
            "--batch-size", "16", "--device", "cpu", "--run-dir", str(run_dir)]
    result = run_train([*args, *(["--shard"] if mode == "shard" else [])], nproc=2, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = _step_records(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1)), sorted(steps)
    graphs = {step: record["compiled_graphs"] for step, record in steps.items()}
    assert graphs[2] > 0, graphs  # compiled by the first step that ran compiled code
    assert graphs[STEPS] == graphs[2], graphs  # the same shapes again: no recompile
    assert "made no graph" not in result.stderr and "global hooks" not in result.stderr, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["flops_per_step"] > 0  # counted on the first step, which ran eagerly
    if mode == "shard":
        assert "(each unit compiled)" in result.stdout
