"""A model whose forward does not use all of its parameters: `find_unused_parameters`.

    python examples/unused_parameters.py
    torchrun --standalone --nproc_per_node=2 examples/unused_parameters.py

Rank 1 routes every batch through an extra head that rank 0 never uses, and one layer is
used by no rank at all. DDP must be told (`session.setup(model, find_unused_parameters=
True)`), or it waits forever for gradients that never come. DDP then reduces a zero for
the head on rank 0, so both replicas take the same (averaged) step, and leaves the
gradient of the layer nobody used at None, so the optimizer does not touch it.
"""

from __future__ import annotations


import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

STEPS, BATCH = 3, 16


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.extra_head = nn.Linear(16, 1)  # used by some ranks only
        self.never_used = nn.Linear(16, 1)  # used by no rank

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        hidden = self.trunk(x)
        out = self.head(hidden)
        return out + self.extra_head(hidden) if use_extra else out


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x[:, :1] - x[:, 2:3]


def flat(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).cpu().tolist()


def train(session: Session) -> dict[str, object]:
    torch.manual_seed(0)
    model = session.setup(Branchy(), find_unused_parameters=True)
    user = session.unwrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # no weight decay: unused stays put
    start = {"never_used": flat(user.never_used), "extra_head": flat(user.extra_head)}
    facts: dict[str, object] = {"skipped": [], "never_used_grad_is_none": []}
    for step in range(STEPS):
        x, y = session.to_device(batch(session.rank, step))
        with session.autocast():
            loss = nn.functional.mse_loss(model(x, use_extra=session.rank == 1), y)
        session.backward(loss)
        facts["never_used_grad_is_none"].append(user.never_used.weight.grad is None)
        facts["skipped"].append(int(session.step(optimizer).skipped))
        optimizer.zero_grad(set_to_none=True)
    facts["never_used_unchanged"] = flat(user.never_used) == start["never_used"]
    facts["extra_head_changed"] = flat(user.extra_head) != start["extra_head"]
    facts["params"] = flat(user)
    return facts


def main() -> None:
    run_example(__doc__.splitlines()[0], train, lambda rank: {k: v for k, v in rank.items() if k != "params"},
                scaler_options={"init_scale": 1024.0})


if __name__ == "__main__":
    main()
