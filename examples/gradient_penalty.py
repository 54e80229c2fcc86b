"""Gradient penalty (double backward) with ddp_amp.Session.

    python examples/gradient_penalty.py
    torchrun --standalone --nproc_per_node=2 examples/gradient_penalty.py

The penalty is the norm of d(loss)/d(params). As in the PyTorch AMP examples, that
gradient is taken of the *scaled* loss (fp16 gradients would underflow otherwise) and
unscaled before it enters the penalty: `session.unscaled_grad` does both and keeps the
graph, so the penalised loss can go through `session.backward` as usual. Under DDP the
first-order `torch.autograd.grad` does not trigger DDP's all-reduce; the final backward
does, once, for the whole penalised loss.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

STEPS, BATCH, LAMBDA = 4, 16, 0.1


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, torch.cat([torch.sin(x[:, :1]), torch.cos(x[:, 1:2])], dim=1)


def penalised(loss: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return loss + LAMBDA * torch.sqrt(sum(g.pow(2).sum() for g in grads))


def flat(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in tensors]).cpu()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def reference(model: nn.Module, world_size: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32: this rank's penalty gradient, and the rank-averaged gradient of the penalised loss."""
    params = list(model.parameters())
    model.zero_grad()
    penalty_grad = None
    for r in range(world_size):
        x, y = batch(r, step)
        loss = nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        if r == rank:
            penalty_grad = flat(grads)
        (penalised(loss, grads) / world_size).backward()
    return penalty_grad, flat([p.grad for p in params])


def train(session: Session) -> dict[str, object]:
    torch.manual_seed(0)
    model = session.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    fp32_copy = copy.deepcopy(session.unwrap(model)).cpu()  # the check runs on the CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    facts: dict[str, object] = {"skipped": []}
    for step in range(STEPS):
        x, y = session.to_device(batch(session.rank, step))
        with session.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        grads = session.unscaled_grad(loss, params)  # d(loss)/d(params), real units, graph kept
        with session.autocast():
            total = penalised(loss, grads)
        session.backward(total)
        if step == 0:
            want_penalty, want_total = reference(fp32_copy, session.world_size, session.rank, step)
            session.scaler.unscale_(optimizer)  # step() will not unscale twice
            facts["scale"] = session.scaler.get_scale()
            facts["penalty_grad_rel_err"] = rel_err(flat(grads), want_penalty)
            facts["total_grad_rel_err"] = rel_err(flat([p.grad for p in params]), want_total)
        result = session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        facts["skipped"].append(int(result.skipped))
    facts["params"] = flat(params).tolist()
    return facts


def main() -> None:
    run_example(__doc__.splitlines()[0], train,
                lambda rank: f"penalty gradient vs fp32, relative error: {rank['penalty_grad_rel_err']}",
                scaler_options={"init_scale": 1024.0})


if __name__ == "__main__":
    main()
