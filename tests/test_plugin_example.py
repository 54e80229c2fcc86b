"""examples/plugin_task.py, as docs/tasks.md's "Your own task" runs it: torchrun, 2 ranks (CI runs it)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multiproc import run_train


def test_plugin_example_trains_under_torchrun_with_two_ranks(tmp_path: Path) -> None:
    result = run_train(["--task", "examples.plugin_task:make_task", "--max-steps", "60",
                        "--eval-every", "30", "--log-every", "1000", "--run-dir", str(tmp_path)], nproc=2)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(accuracy) == [0, 30, 60] and summary["world_size"] == 2
    assert accuracy[0] < 0.6 < 0.75 < accuracy[60] == summary["eval_accuracy"], accuracy
