"""No checkpoint holds a non-finite state, and the stop names the one to resume from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddp_amp.checkpoint import safe_load, verify_checkpoint
from tests.multiproc import run_train

POISONED = ["--task", "tests.plugins.nonfinite_task:make_task", "--task-opt", "poison=rank_loss",
            "--task-opt", "bad_rank=1", "--task-opt", "from_step=12", "--device", "cpu", "--batch-size", "16",
            "--max-steps", "60", "--ckpt-every", "5", "--keep-last", "3", "--log-every", "50"]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_nan_on_one_rank_between_checkpoints_is_never_committed(tmp_path: Path, precision: str) -> None:
    result = run_train([*POISONED, "--precision", precision, "--run-dir", str(tmp_path)], nproc=2, timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    root = tmp_path / "checkpoints"
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000005", "step-00000010"], kept  # step 15 was not written
    for name in kept:
        verify_checkpoint(root / name)
        weights = safe_load(root / name / "model.pt")
        assert all(torch.isfinite(tensor).all() for tensor in weights.values()), name
    stops = [line for line in result.stderr.splitlines() if line.startswith("ddp_amp: stopped:")]
    assert len(stops) == 1, result.stderr[-3000:]
    assert "not checkpointing step 15: the loss first went non-finite at step 12" in stops[0]
    assert f"resume from {root / 'step-00000010'}, the newest finite checkpoint" in stops[0]
