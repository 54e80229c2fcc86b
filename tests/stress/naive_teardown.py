"""A plain DDP fp16 script that destroys the process group while its DDP model is alive.

The control for tests/stress/teardown.py: this is the order most hand-written scripts use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
scaler = torch.amp.GradScaler("cpu")
for _ in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(64, 256)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()  # DDP model, reducer and optimizer still alive here
