"""The scaler's fast path: no found-inf all-reduce in the Trainer's normal step, agreement otherwise.

Two real gloo ranks (tests/multiproc.py). fp16 on a CPU is slow, so the model is tiny and
the steps few.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ddp_amp.bench.overhead import make_trainer
from ddp_amp.bench.recipe import RecipeSize, make_batches
from ddp_amp.config import parse_config
from ddp_amp.dist import DistContext
from ddp_amp.errors import UsageError
from ddp_amp.amp import Precision
from tests.multiproc import run_ranks

SIZE = RecipeSize(width=16, batch=8, layers=2)


def _checksum(trainer: Any) -> float:
    return float(sum(p.detach().double().sum() for p in trainer.params))


def _manual_step(trainer: Any, batch: tuple[torch.Tensor, torch.Tensor], factor: float, replace: bool) -> None:
    """Backward through DDP, then (on every rank, SPMD) change one gradient after the reduction."""
    inputs, target = batch
    trainer.scaler.scale(nn.functional.mse_loss(trainer.model(inputs), target)).backward()
    trainer.scaler.mark_reduced(trainer._reduced_params)
    grad = trainer.params[0].grad
    if replace:
        trainer.params[0].grad = grad * factor  # a new tensor: not the one DDP reduced
    else:
        grad.mul_(factor)  # in place: bumps the version counter
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    trainer.optimizer.zero_grad(set_to_none=True)


def _fast_path_rank(ctx: DistContext) -> dict[str, Any]:
    precision = Precision("fp16", "cpu")
    batches = make_batches(SIZE, 2, ctx.device, seed=1 + ctx.rank)
    out: dict[str, Any] = {}
    for label, options in (("plain", {}), ("bf16_comm_static", {"grad_comm_dtype": "bf16", "static_graph": True})):
        trainer = make_trainer(ctx, SIZE, precision, batches, **options)
        for _ in range(3):
            trainer.train_step()
        out[label] = {"skipped_collectives": trainer.scaler.agreements_skipped, "checksum": _checksum(trainer),
                      "steps_skipped": int(trainer.scaler.skipped_steps().item())}
    # Rank 1's gradient becomes inf after DDP's reduction; rank 0's stays finite.
    factor = float("inf") if ctx.rank == 1 else 1.0
    for replace in (False, True):
        before = trainer.scaler.agreements_skipped
        _manual_step(trainer, batches[0], factor, replace)
        out[f"modified_replace={replace}"] = {
            "skipped": int(trainer.scaler.last_step_skipped().item()),
            "collective_ran": trainer.scaler.agreements_skipped == before,
            "checksum": _checksum(trainer)}
    return out


def test_trainer_skips_the_collective_and_modified_grads_still_agree() -> None:
    rank0, rank1 = run_ranks(_fast_path_rank, 2, timeout=240)
    for label in ("plain", "bf16_comm_static"):
        # (1) the Trainer's normal step proves the reduction and skips the all-reduce
        assert rank0[label]["skipped_collectives"] == 3 == rank1[label]["skipped_collectives"], label
        assert rank0[label]["steps_skipped"] == rank1[label]["steps_skipped"]
        assert rank0[label]["checksum"] == rank1[label]["checksum"], label
    for replace in (False, True):
        a, b = rank0[f"modified_replace={replace}"], rank1[f"modified_replace={replace}"]
        # (2) a gradient changed after the reduction: the all-reduce runs and both ranks skip
        assert a["collective_ran"] and b["collective_ran"], replace
        assert a["skipped"] == 1 == b["skipped"], (replace, a, b)
        assert a["checksum"] == b["checksum"]


def test_fast_path_options_are_validated() -> None:
    config = parse_config(["--grad-comm-dtype", "bf16", "--static-graph", "--optimizer-impl", "foreach"])
    assert (config.grad_comm_dtype, config.static_graph, config.optimizer_impl) == ("bf16", True, "foreach")
    with pytest.raises(UsageError, match="--grad-comm-dtype"):
        parse_config(["--grad-comm-dtype", "fp8"])
