"""Several models, optimizers and losses sharing one loss scaler.

    python examples/multiple_models.py
    torchrun --standalone --nproc_per_node=2 examples/multiple_models.py

One scaler serves every model: `session.step(opt0, opt1)` steps each optimizer (an
optimizer whose gradients hold inf/NaN on *any* rank is skipped on every rank) and then
updates the scale once. Both losses depend on both models; under DDP each forward allows
one backward, so the losses are summed and go through one `session.backward` (the
gradients equal those of two backwards of the two scaled losses).

At step INJECT, rank 1 (only) poisons one of model1's gradients after DDP's all-reduce:
a rank-local overflow. The agreed scaler makes rank 0 skip optimizer 1 too, so the
replicas stay identical; optimizer 0 still steps; the scale backs off once.
"""

from __future__ import annotations


import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

STEPS, BATCH, INJECT = 4, 16, 2


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x[:, :1] * x[:, 1:2]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu()


def train(session: Session) -> dict[str, object]:
    torch.manual_seed(0)
    model0 = session.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    model1 = session.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.05)
    opt1 = torch.optim.AdamW(model1.parameters(), lr=0.01)
    facts: dict[str, object] = {"inject_step": INJECT, "scales": [], "skipped": [],
                                "model0_changed": [], "model1_changed": []}
    for step in range(STEPS):
        x, y = session.to_device(batch(session.rank, step))
        with session.autocast():
            out0, out1 = model0(x), model1(x)
            loss0 = nn.functional.mse_loss(2 * out0 + 3 * out1, y)
            loss1 = nn.functional.mse_loss(3 * out0 - 5 * out1, y)
        session.backward(loss0 + loss1)
        if step == INJECT and session.rank == 1:
            next(model1.parameters()).grad.view(-1)[0] = float("inf")
        before0, before1 = flat(model0), flat(model1)
        result = session.step(opt0, opt1)  # each optimizer steps (or skips), one update
        opt0.zero_grad(set_to_none=True)
        opt1.zero_grad(set_to_none=True)
        facts["model0_changed"].append(not torch.equal(before0, flat(model0)))
        facts["model1_changed"].append(not torch.equal(before1, flat(model1)))
        facts["scales"].append(session.scaler.get_scale())
        facts["skipped"].append(int(result.skipped))
    facts["params"] = torch.cat([flat(model0), flat(model1)]).tolist()
    return facts


def main() -> None:
    run_example(__doc__.splitlines()[0], train, lambda rank: f"scales: {rank['scales']}",
                scaler_options={"init_scale": 1024.0})


if __name__ == "__main__":
    main()
