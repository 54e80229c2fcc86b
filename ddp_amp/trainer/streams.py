"""Which resumable stream of micro-batches a task's training data becomes, on one rank.

- `Task.make_loader`: the task's own loader, sharded by the task (task_loader.py);
- an `IterableDataset`: strided over ranks and workers, resumed by replay (iterable_stream.py);
- a map-style dataset: a shuffled shard per rank, resumed by position, and mappable onto
  another world size (stream.py).
The first two keep a position per rank (loader_stream.py); a checkpoint saves every rank's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import IterableDataset

from ddp_amp.distributed import DistContext
from ddp_amp.tasks import Task
from ddp_amp.trainer.iterable_stream import iterable_stream
from ddp_amp.trainer.loader_stream import LoaderStream
from ddp_amp.trainer.stream import BatchStream, collate
from ddp_amp.trainer.task_loader import task_loader_stream

Stream = BatchStream | LoaderStream


def make_stream(task: Task, ctx: DistContext, micro_batch_size: int, num_workers: int, seed: int,
                worker_init_fn: Callable[[int], None]) -> Stream:
    """This rank's stream over the task's training data (collective for a task's own loader:
    its pass lengths are compared). `worker_init_fn` goes to every DataLoader worker."""
    device: torch.device = ctx.device
    if task.make_loader is not None:
        return task_loader_stream(task.make_loader, task.schedule_on, ctx, device, micro_batch_size, num_workers,
                                  seed, worker_init_fn)
    if isinstance(task.train_data, IterableDataset):
        return iterable_stream(task.train_data, micro_batch_size, ctx.rank, ctx.world_size, device, num_workers,
                               collate_fn=collate, worker_init_fn=worker_init_fn)
    return BatchStream(task.train_data, micro_batch_size, ctx.rank, ctx.world_size, seed, device,  # type: ignore[arg-type]
                       num_workers, worker_init_fn=worker_init_fn)
