"""Rank 1 raises inside its Session block while rank 0 waits in a collective (run by tests under torchrun)."""

from __future__ import annotations

import torch
from torch import nn

from ddp_amp import Session

with Session("fp32", "cpu") as session:
    model = session.setup(nn.Linear(4, 1))
    if session.rank == 1:
        raise RuntimeError("planted failure in rank 1's own loop")
    model(torch.randn(2, 4)).sum().backward()  # rank 0: an all-reduce rank 1 never joins
    session.all_gather_objects("never reached by rank 1")
