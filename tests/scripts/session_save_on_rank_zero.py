"""Rank 0 alone calls `save` (the `if master_process:` pattern) while rank 1 trains on
(run by tests under torchrun). argv[1]: the checkpoint directory."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from ddp_amp import Session

# A short arrival deadline: rank 1 never comes, so its length only sets how long the test waits.
with Session("fp32", "cpu", save_arrival_s=5) as session:
    model = session.setup(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        session.backward(model(torch.randn(2, 4)).square().mean())  # rank 1 waits here, in step 3
        session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        session.set_step(step)
        if session.is_main and step == 2:
            session.save(Path(sys.argv[1]) / "step-2", {"model": model, "step": step})
