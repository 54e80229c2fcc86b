"""A task's own training loader (`Task.make_loader`): built once per rank, checked, and
streamed pass after pass with an exact resume (loader_stream.py).

The task shards the data itself, over the data-parallel ranks its `LoaderRequest` names (a
`DistributedSampler(rank=..., num_replicas=...)`, or a stream that yields each rank its
share). Ranks' passes may differ in length, except where the schedule steps per epoch: there
every rank must turn over at the same step, so the lengths are compared once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ddp_amp.data.loader_stream import LoaderStream, loader_length
from ddp_amp.distributed import DistContext, all_gather_objects
from ddp_amp.errors import UsageError


@dataclass(frozen=True)
class LoaderRequest:
    """What `Task.make_loader` is told about the rank it builds a loader for.

    `rank` and `world_size` are the data-parallel rank and size (the device mesh's): shard
    the data over them, so ranks that differ only in a model-parallel dimension read the
    same batches. They equal the world rank and size where every rank is data parallel.
    """

    rank: int
    world_size: int
    micro_batch_size: int  # items per batch on this rank: --batch-size / (data-parallel size x --grad-accum)
    num_workers: int  # --num-workers
    seed: int  # --seed: for a sampler's shuffle (DistributedSampler(seed=...))
    device: torch.device  # where batches go: pin_memory=device.type == "cuda" pays there
    # Makes DataLoader workers ignore the signals the main process handles (preemption);
    # pass it on as worker_init_fn, or call it first in your own.
    worker_init_fn: Callable[[int], None]


LoaderFactory = Callable[[LoaderRequest], Iterable[Any]]


def task_loader_stream(make_loader: LoaderFactory, schedule_on: str, ctx: DistContext, device: torch.device,
                       micro_batch_size: int, num_workers: int, seed: int,
                       worker_init_fn: Callable[[int], None]) -> LoaderStream:
    """This rank's stream over the loader `make_loader` (a task's) builds, for a schedule that
    steps on `schedule_on` (collective: lengths are gathered)."""
    request = LoaderRequest(rank=ctx.dp_rank, world_size=ctx.dp_size, micro_batch_size=micro_batch_size,
                            num_workers=num_workers, seed=seed, device=device, worker_init_fn=worker_init_fn)
    loader = make_loader(request)
    if not all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict", "__iter__")):
        raise UsageError("Task.make_loader", f"a {type(loader).__name__}",
                         "an iterable loader with state_dict() and load_state_dict(), "
                         "so a resume restores its position",
                         "build torchdata.stateful_dataloader.StatefulDataLoader(...) where you built a DataLoader")
    lengths = all_gather_objects(loader_length(loader)) if ctx.world_size > 1 else [loader_length(loader)]
    same = lengths[0] if lengths[0] is not None and len(set(lengths)) == 1 else None
    if schedule_on == "epoch" and same is None:
        raise UsageError("Task.schedule_on", "epoch", "loaders of one known length on every rank "
                         f"(batches per pass: {', '.join(str(n) for n in lengths)})",
                         "shard with DistributedSampler(drop_last=True) and a DataLoader(drop_last=True), "
                         "or schedule per step")
    return LoaderStream(loader, micro_batch_size, device, "Task.make_loader", batches_per_epoch=same)
