"""Gradient accumulation with ddp_amp.Session: K micro-batches per optimizer step.

    python examples/accumulate.py                                         # one process
    torchrun --standalone --nproc_per_node=2 examples/accumulate.py       # two ranks

Every micro-batch but the last runs forward *and* backward inside `session.no_sync(model)`,
so DDP all-reduces once per step. Each micro-loss is divided by K so the accumulated
gradient is the mean over the effective batch. The scaler steps and updates once per
effective batch, never per micro-batch: the scale is a per-step quantity.
"""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext

import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

ACCUM, STEPS, MICRO_BATCH = 4, 3, 8


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic micro-batch: any rank can rebuild any other rank's data."""
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    x = torch.randn(MICRO_BATCH, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


def reference_grad(model: nn.Module, world_size: int, step: int) -> torch.Tensor:
    """fp32 gradient of the mean loss over the whole effective batch (all ranks, all micro-batches)."""
    model.zero_grad()
    losses = [nn.functional.mse_loss(model(x), y) for x, y in
              (batch(r, step, m) for r in range(world_size) for m in range(ACCUM))]
    torch.stack(losses).mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def train(session: Session) -> dict[str, object]:
    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    model = session.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    reference = copy.deepcopy(session.unwrap(model)).float().cpu()  # the check runs on the CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    facts: dict[str, object] = {"scales": [], "skipped": [], "grad_rel_err": None}
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = session.to_device(batch(session.rank, step, micro))
            last = micro == ACCUM - 1
            with nullcontext() if last else session.no_sync(model):
                with session.autocast():
                    loss = nn.functional.mse_loss(model(x), y) / ACCUM
                session.backward(loss)
        if step == 0:  # check the accumulated, all-reduced gradient against fp32
            session.scaler.unscale_(optimizer)  # step() will not unscale twice
            got = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
            want = reference_grad(reference, session.world_size, step)
            facts["grad_rel_err"] = ((got - want).norm() / want.norm()).item()
        result = session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        facts["scales"].append(session.scaler.get_scale())
        facts["skipped"].append(int(result.skipped))
    facts["params"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return facts


def main() -> None:
    # growth_interval=1: the scale doubles at every update, so its value counts the updates.
    run_example(__doc__.splitlines()[0], train, lambda rank: json.dumps(rank["scales"]),
                scaler_options={"init_scale": 256.0, "growth_interval": 1})


if __name__ == "__main__":
    main()
