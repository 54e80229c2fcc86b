"""Tasks that build their own training loader (`Task.make_loader`): a torchdata
`StatefulDataLoader` over a `DistributedSampler`, shuffled per pass, with the LR halved per
pass; and two a resume could not trust, which are refused."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ddp_amp import LoaderRequest, Task, TrainConfig
from ddp_amp.tasks import LoaderFactory

FEATURES = 6


def teacher_data(items: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(items, FEATURES, generator=generator)
    return TensorDataset(inputs, inputs @ torch.randn(FEATURES, 1, generator=generator))


def _task(make_loader: LoaderFactory, items: int = 96) -> Task:
    return Task(model=nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1)),
                make_loader=make_loader, loss_fn=nn.functional.mse_loss, default_lr=0.05,
                make_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5),
                schedule_on="epoch")


def stateful_loader(request: LoaderRequest, items: int = 96) -> StatefulDataLoader:
    data = teacher_data(items)
    sampler = DistributedSampler(data, num_replicas=request.world_size, rank=request.rank,
                                 shuffle=True, seed=request.seed, drop_last=True)
    return StatefulDataLoader(data, batch_size=request.micro_batch_size, sampler=sampler, drop_last=True,
                              num_workers=request.num_workers, worker_init_fn=request.worker_init_fn)


def make_task(config: TrainConfig) -> Task:
    return _task(stateful_loader)


def plain_loader(config: TrainConfig) -> Task:
    """torch's DataLoader keeps no position: a resume could not continue where it stopped."""
    return _task(lambda request: DataLoader(teacher_data(96), batch_size=request.micro_batch_size))


def uneven_loader(config: TrainConfig) -> Task:
    """Rank 1's pass is longer, so a per-pass schedule would change ranks' LRs at different steps."""
    return _task(lambda request: stateful_loader(request, items=96 + 48 * request.rank))
