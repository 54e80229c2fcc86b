"""The CLI trains on one process: the mlp task, a short run (the default task: test_trainer_eval)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multiproc import run_train


def test_single_process_trains_and_writes_summary(tmp_path: Path) -> None:
    result = run_train(["--task", "mlp", "--max-steps", "40", "--log-every", "10", "--run-dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert summary["steps"] == 40 and summary["world_size"] == 1
    assert losses[-1] < losses[0] * 0.8, losses
