"""Gradient clipping with ddp_amp.Session: clip in real gradient units, not scaled ones.

    python examples/clip.py
    torchrun --standalone --nproc_per_node=2 examples/clip.py

`session.step(optimizer, clip_grad_norm=MAX_NORM)` unscales the gradients first (under fp16
they hold loss * scale), clips their total norm to MAX_NORM, then steps unless any rank
found inf/NaN. It returns the norm before clipping, in real units, for logging.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

STEPS, BATCH, MAX_NORM = 5, 16, 1.0


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, 3.0 * x[:, :1] - x[:, 1:2]


def grad_norm(params: list[nn.Parameter]) -> float:
    return torch.cat([p.grad.detach().float().flatten() for p in params]).norm().item()


def reference_norm(model: nn.Module, world_size: int, step: int) -> float:
    """The fp32 norm of the rank-averaged gradient, as DDP would reduce it."""
    model.zero_grad()
    for rank in range(world_size):
        x, y = batch(rank, step)
        (nn.functional.mse_loss(model(x), y) / world_size).backward()
    return grad_norm(list(model.parameters()))


def train(session: Session) -> dict[str, object]:
    torch.manual_seed(0)
    model = session.setup(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    reference = copy.deepcopy(session.unwrap(model)).cpu()  # the check runs on the CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    facts: dict[str, object] = {"max_norm": MAX_NORM, "pre_clip": [], "post_clip": [], "skipped": []}
    for step in range(STEPS):
        x, y = session.to_device(batch(session.rank, step))
        with session.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        if step == 0:
            facts["reference_norm"] = reference_norm(reference, session.world_size, step)
        result = session.step(optimizer, clip_grad_norm=MAX_NORM)
        # The gradients are still there, unscaled and clipped, until zero_grad.
        facts["pre_clip"].append(result.grad_norm.item())
        facts["post_clip"].append(grad_norm(params))
        facts["skipped"].append(int(result.skipped))
        optimizer.zero_grad(set_to_none=True)
    facts["params"] = torch.cat([p.detach().flatten() for p in params]).tolist()
    return facts


def main() -> None:
    run_example(__doc__.splitlines()[0], train, lambda rank: f"pre-clip norms: {rank['pre_clip']}",
                scaler_options={"init_scale": 1024.0})


if __name__ == "__main__":
    main()
