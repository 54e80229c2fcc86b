"""Leave a Session while its DDP model is still referenced (run under torchrun by tests).

The order of most hand-written scripts: the model lives in the same frame as the `with`.
The session must release the wrapper before it destroys the group, and the job must exit
cleanly. Writes rank 0's observations to the JSON file named by argv[1].
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from ddp_amp import Session

with Session("fp16", "cpu", scaler_options={"init_scale": 1024.0}) as session:
    torch.manual_seed(0)
    model = session.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(3):
        with session.autocast():
            loss = model(torch.randn(6, 4)).float().pow(2).mean()
        session.backward(loss)
        session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    rank = session.rank
facts = {"group_gone": not dist.is_initialized(), "reducer_released": not hasattr(model, "reducer"),
         "model_alive": model is not None}
if rank == 0:
    with open(sys.argv[1], "w", encoding="utf-8") as handle:
        json.dump(facts, handle)
