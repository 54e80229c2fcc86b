"""No device-to-host synchronisation in a steady-state fp16 training step on a GPU.

Runs only where CUDA exists (`cuda` marker). fp16 with a fused optimizer, not a logging
step: `torch.cuda.set_sync_debug_mode("error")` turns any synchronising call (`.item()`,
a blocking copy to the host, a `nonzero`) into an error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ddp_amp.bench.overhead import make_trainer
from ddp_amp.dist.spawn import run_ranks
from ddp_amp.bench.recipe import RecipeSize, make_batches
from ddp_amp.dist import DistContext
from ddp_amp.trainer.lr_steps import TakenStepScheduler
from ddp_amp.amp import Precision

SIZE = RecipeSize(width=256, batch=64, layers=3)


def _steps_without_sync(ctx: DistContext, optimizer_impl: str, scheduler: bool = False) -> dict[str, Any]:
    precision = Precision("fp16", "cuda")
    batches = make_batches(SIZE, 4, ctx.device, seed=ctx.rank)
    trainer = make_trainer(ctx, SIZE, precision, batches, optimizer_impl=optimizer_impl)
    if scheduler:  # lm's kind: the LR changes once an epoch, so no step here reads a skip flag
        trainer.scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=100, gamma=0.95)
        trainer.lr_steps = TakenStepScheduler(trainer.scheduler, trainer.scaler)
    for _ in range(3):  # warm-up: lazy inits (scale tensor, optimizer state, DDP buckets)
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"fused": bool(trainer.optimizer.defaults.get("fused")), "steps": trainer.step,
            "agreements": trainer.scaler.agreements}


@pytest.mark.cuda
@pytest.mark.parametrize("scheduler", [False, True])
def test_single_gpu_fp16_fused_step_has_no_host_sync(scheduler: bool) -> None:
    result = run_ranks(_steps_without_sync, 1, "fused", scheduler, device="cuda", threads=0)[0]
    assert result["fused"] and result["steps"] == 8


@pytest.mark.cuda
def test_ddp_over_nccl_on_one_gpu_fp16_fused_step_has_no_host_sync() -> None:
    # --backend nccl with one process: a group of one, so DDP's bucketed all-reduce over
    # NCCL, the overflow probe's comm hook and the scaler's fast path all run on one GPU.
    result = run_ranks(_steps_without_sync, 1, "fused", device="cuda", backend="nccl", threads=0)[0]
    assert result["fused"] and result["steps"] == 8
    assert result["agreements"] == 0  # one rank has no peer to agree with


@pytest.mark.cuda
def test_ddp_fp16_fused_step_has_no_host_sync() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: two nccl ranks cannot share one GPU")
    results = run_ranks(_steps_without_sync, 2, "fused", device="cuda", threads=0)
    assert all(r["fused"] and r["steps"] == 8 for r in results)
    # every step agreed on its skip decision, with no host sync
    assert all(r["agreements"] == 8 for r in results)
