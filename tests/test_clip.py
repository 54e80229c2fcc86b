"""Clipping: over the parameters the caller names, in the caller's order, as torch's own
`clip_grad_norm_` clips them; and under `--shard`, DDP's norm on any number of ranks. Real
gloo ranks throughout."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp import DistContext, Session, TrainConfig, UsageError
from ddp_amp.parallel import ShardOptions
from ddp_amp.tasks import load_task
from ddp_amp.trainer import seed_everything
from ddp_amp.torch_api import DTensor
from tests.multiproc import in_turn, run_ranks
from tests.resume_harness import assert_bitwise_equal
from tests.torch_features import needs_sharding

CLIP = 0.05  # bites at every step of the loop below


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 50))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's groups: matrices decayed, vectors not, so the optimizer's order is not the model's."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(0, 50, (8,), generator=generator), torch.randint(0, 50, (8,), generator=generator))
            for _ in range(8)]


def _session_loop(ctx: DistContext) -> dict[str, torch.Tensor]:
    with Session("fp32", "cpu", backend="gloo", environ=os.environ) as session:
        model = session.setup(_model())
        optimizer = _optimizer(model)
        for x, y in _batches(ctx.rank):
            session.backward(nn.functional.cross_entropy(model(x), y))
            session.step(optimizer, clip_grad_norm=CLIP, clip_params=model.parameters())
            optimizer.zero_grad(set_to_none=True)
        return {name: p.detach().clone() for name, p in session.unwrap(model).named_parameters()}


def _hand_written_loop(ctx: DistContext) -> dict[str, torch.Tensor]:
    """A plain PyTorch loop: DDP where there are ranks, torch's clip_grad_norm_ over model.parameters()."""
    with Session("fp32", "cpu", backend="gloo", environ=os.environ):  # only for the process group
        plain = _model()
        model = DDP(plain) if dist.is_initialized() else plain
        optimizer = _optimizer(model)
        for x, y in _batches(ctx.rank):
            nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {name: p.detach().clone() for name, p in plain.named_parameters()}


def _both(ctx: DistContext) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _session_loop(ctx), _hand_written_loop(ctx)


@pytest.mark.parametrize("ranks", [1, 2])
def test_clipping_the_named_parameters_is_torchs_clip_grad_norm_bitwise(ranks: int) -> None:
    for session_weights, hand_weights in run_ranks(_both, ranks, timeout=240):
        assert_bitwise_equal(session_weights, hand_weights)


def test_clip_params_outside_the_optimizers_is_refused() -> None:
    with Session("fp32", "cpu", environ={}) as session:
        model = session.setup(_model())
        optimizer = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
        session.backward(model(torch.tensor([1, 2])).sum())
        with pytest.raises(UsageError, match="clip_params"):
            session.step(optimizer, clip_grad_norm=1.0, clip_params=model.parameters())


LM_OPTIONS = ("emsize=32", "nhid=32", "vocab=300", "tokens=20000", "bptt=16", "dropout=0")


def _lm_step(ctx: DistContext, shard: bool) -> dict[str, object]:
    """One SGD step of the lm task at clip 0.5, every rank the same batch: the weights after
    it, whole, the norm the step reported and the exact (fp64) norm of the gradients."""
    config = TrainConfig(task="lm", task_opt=LM_OPTIONS, device="cpu", precision="fp32", batch_size=8)
    seed_everything(config.seed)
    task = load_task("lm", config)
    tokens, target = (torch.stack(column) for column in zip(*(task.train_data[i] for i in range(8)), strict=True))
    with Session("fp32", "cpu", backend="gloo", environ=os.environ,
                 shard=ShardOptions() if shard else None) as session:
        assert task.build_model is not None  # the lm task builds its model: sharded, each rank its rows only
        model = session.setup(session.build_model(task.build_model), units=task.shard_units)
        optimizer = torch.optim.SGD(model.parameters(), lr=task.default_lr)
        session.backward(task.loss_fn(model(tokens), target))
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        exact = torch.stack([g.double().pow(2).sum() for g in grads if g is not None]).sum().sqrt().float()
        result = session.step(optimizer, clip_grad_norm=0.5)
        weights = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for name, p in session.unwrap(model).named_parameters()}
    return {"weights": weights, "norm": result.grad_norm, "exact": exact}


@pytest.mark.parametrize("ranks", [2, 4])
@needs_sharding
def test_the_sharded_clipping_norm_is_ddps(ranks: int) -> None:
    # Replicated, then sharded, in the same rank processes (one start-up of the ranks).
    runs = run_ranks(in_turn, ranks, (_lm_step, False), (_lm_step, True), timeout=300)
    replicated, sharded = runs[0][0], [run[1] for run in runs]
    assert float(replicated["norm"]) > 0.5  # type: ignore[arg-type]  # the clip bites
    for rank in sharded:
        # The split-independent norm: the gradients' exact norm rounded to fp32, on every rank.
        assert torch.equal(rank["norm"], rank["exact"])  # type: ignore[arg-type]
        assert float(rank["norm"]) == pytest.approx(float(replicated["norm"]), rel=1e-6)  # type: ignore[arg-type]
        for name, weight in replicated["weights"].items():  # type: ignore[attr-defined]
            torch.testing.assert_close(rank["weights"][name], weight, rtol=1e-6, atol=1e-7)  # type: ignore[index]
