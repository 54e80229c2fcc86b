"""Micro-batches from an `IterableDataset` (a stream: tokenized shards, a streaming dataset),
with per-rank sharding and an exact resume, through torchdata's `StatefulDataLoader`.

Sharding: the dataset yields the whole stream in every process; item k goes to data-parallel
rank r and DataLoader worker w when `k % (ranks x workers) == r x workers + w`. Every item is
used once per pass, by one data-parallel rank's worker, whatever the number of ranks and
workers (ranks that share a data-parallel rank read the same items). A dataset must
therefore not shard itself (by `get_worker_info` or by rank).

An epoch is one pass over the stream; the next pass starts when a rank's share is used
up. Ranks' shares differ by at most one item, so their epochs may turn over a batch apart:
the epoch-wise LR cadence is refused for iterable data (it would change ranks' LRs at
different steps).

Resume (loader_stream.py): `StatefulDataLoader` saves how many batches each worker has yielded in this pass,
and on resume replays the pass up to there: exact for any deterministic stream, at the cost
of reading that part of the pass again. Each rank's position is its own, so a checkpoint
holds every rank's and a resume needs the same world size.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddp_amp.data.loader_stream import LoaderStream


class RankShard(IterableDataset):
    """`dataset`'s items for one data-parallel rank (`rank` of `world_size`), split again over
    that rank's DataLoader workers."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        workers, index = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        stride, offset = self.world_size * workers, self.rank * workers + index
        for position, item in enumerate(self.dataset):
            if position % stride == offset:
                yield item


def iterable_stream(dataset: IterableDataset, micro_batch_size: int, rank: int, world_size: int,
                    device: torch.device, num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                    worker_init_fn: Callable[[int], None] | None = None) -> LoaderStream:
    """An endless stream of micro-batches for one rank over passes of an iterable dataset;
    `rank` and `world_size` are the data-parallel rank and size."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    # Its warning on each resume asks the dataset for a state_dict; the replay it
    # announces is the documented behaviour here (RankShard keeps no state of its own).
    logging.getLogger(StatefulDataLoader.__module__).setLevel(logging.ERROR)
    with warnings.catch_warnings():  # torchdata calls a torch function that warns it is deprecated
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = StatefulDataLoader(RankShard(dataset, rank, world_size), batch_size=micro_batch_size,
                                    drop_last=True, num_workers=num_workers, collate_fn=collate_fn,
                                    pin_memory=device.type == "cuda", worker_init_fn=worker_init_fn)
    # The pass's length is unknown until it ends, and ranks' shares may differ by an item.
    return LoaderStream(loader, micro_batch_size, device, "Task.train_data", batches_per_epoch=None)
