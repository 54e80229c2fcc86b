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


def test_on_a_cpu_the_guard_holds_no_loss_and_still_finds_the_first_bad_step() -> None:
    # Kept 0-d tensors pin the C heap: a CPU process grew by about 1 GB per 100 lm steps
    # while the guard held every loss until its fold (docs/facts.md).
    import gc
    import weakref

    from ddp_amp.guards.finite import FOLD_EVERY, FiniteStateGuard

    guard = FiniteStateGuard(torch.device("cpu"), track_losses=True)
    losses = [torch.tensor(2.0) for _ in range(8)]
    alive = [weakref.ref(loss) for loss in losses]
    for step, loss in enumerate(losses, start=1):
        guard.record(step, loss)
    del losses, loss
    gc.collect()
    assert all(ref() is None for ref in alive)  # read at once, none held
    for step in range(len(alive) + 1, FOLD_EVERY + 40):  # across a fold
        guard.record(step, torch.tensor(float("nan") if step in (FOLD_EVERY + 7, FOLD_EVERY + 9) else 1.0))
    guard.restart()
    assert guard.first_bad_step == FOLD_EVERY + 7
