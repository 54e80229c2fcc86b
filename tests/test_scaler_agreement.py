"""The agreed skip decision holds whatever a rank does to its own gradients: no per-rank shortcut.

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
from ddp_amp.command_line import parse_command_line
from ddp_amp.distributed import DistContext
from ddp_amp.errors import UsageError
from ddp_amp.amp import Precision
from tests.multiproc import run_ranks

SIZE = RecipeSize(width=16, batch=8, layers=2)


def _checksum(trainer: Any) -> float:
    return float(sum(p.detach().double().sum() for p in trainer.params))


def _manual_step(trainer: Any, batch: tuple[torch.Tensor, torch.Tensor], factor: float | None,
                 replace: bool) -> None:
    """Backward through DDP, then, where `factor` is given (one rank only), change one gradient
    after the reduction; the other ranks run no such code at all."""
    inputs, target = batch
    # The fp16 output in fp32 against the fp32 target, as the recipe's loss has it (torch 2.4's
    # mse_loss backward refuses the two dtypes mixed).
    trainer.scaler.scale(nn.functional.mse_loss(trainer.model(inputs).float(), target)).backward()
    grad = trainer.params[0].grad
    if factor is not None and replace:
        trainer.params[0].grad = grad * factor  # a new tensor: not the one DDP reduced
    elif factor is not None:
        grad.mul_(factor)  # in place
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    trainer.optimizer.zero_grad(set_to_none=True)


def _agreement_rank(ctx: DistContext) -> dict[str, Any]:
    precision = Precision("fp16", "cpu")
    batches = make_batches(SIZE, 2, ctx.device, seed=1 + ctx.rank)
    out: dict[str, Any] = {}
    for label, options in (("plain", {}), ("bf16_comm_static", {"grad_comm_dtype": "bf16", "static_graph": True})):
        trainer = make_trainer(ctx, SIZE, precision, batches, **options)
        for _ in range(3):
            trainer.train_step()
        out[label] = {"agreements": trainer.scaler.agreements, "checksum": _checksum(trainer),
                      "steps_skipped": int(trainer.scaler.skipped_steps().item())}
    # Rank 1 alone makes a gradient inf after DDP's reduction; rank 0 touches nothing.
    factor = float("inf") if ctx.rank == 1 else None
    for replace in (False, True):
        before = trainer.scaler.agreements
        _manual_step(trainer, batches[0], factor, replace)
        out[f"modified_replace={replace}"] = {
            "skipped": int(trainer.scaler.last_step_skipped().item()),
            "agreed": trainer.scaler.agreements == before + 1,
            "checksum": _checksum(trainer)}
    return out


def test_one_rank_changing_its_gradient_after_the_reduction_still_agrees() -> None:
    rank0, rank1 = run_ranks(_agreement_rank, 2, timeout=240)
    for label in ("plain", "bf16_comm_static"):
        # (1) every step of the Trainer agrees, on every rank alike
        assert rank0[label]["agreements"] == 3 == rank1[label]["agreements"], label
        assert rank0[label]["steps_skipped"] == rank1[label]["steps_skipped"]
        assert rank0[label]["checksum"] == rank1[label]["checksum"], label
    for replace in (False, True):
        a, b = rank0[f"modified_replace={replace}"], rank1[f"modified_replace={replace}"]
        # (2) both ranks ran the one all-reduce, both skip, and the replicas stay equal
        assert a["agreed"] and b["agreed"], replace
        assert a["skipped"] == 1 == b["skipped"], (replace, a, b)
        assert a["checksum"] == b["checksum"]


def test_fast_path_options_are_validated() -> None:
    config = parse_command_line(["--grad-comm-dtype", "bf16", "--static-graph", "--optimizer-impl", "foreach"]).config
    assert (config.grad_comm_dtype, config.static_graph, config.optimizer_impl) == ("bf16", True, "foreach")
    with pytest.raises(UsageError, match="--grad-comm-dtype"):
        _ = parse_command_line(["--grad-comm-dtype", "fp8"]).config
