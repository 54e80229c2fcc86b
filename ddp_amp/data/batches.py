"""An endless, resumable stream of per-rank micro-batches of a map-style dataset, over epochs.

Order: each epoch visits the dataset in a seeded order computed per index (`GlobalOrder`,
order.py: O(1) memory, no permutation built), the same on every rank. An epoch is the first
`samples_per_epoch` positions of that order: the dataset's size rounded down to a whole
number of optimizer steps (`samples_per_step`, the global batch). Positions are dealt out
per micro-step: micro-batch j of data-parallel rank r holds positions
`(j * ranks + r) * m ... + m - 1`. So the samples of optimizer step k are positions
`k * B ... (k + 1) * B - 1` of the epoch's order whatever the number of ranks, micro-batch
size and accumulation that make up B, and ranks see disjoint shares (ranks that share a
data-parallel rank see the same one).

The position (epoch, micro-batch within the epoch) is part of a checkpoint, and
`load_state_dict` resumes at exactly that micro-batch. It maps onto another number of
data-parallel ranks wherever the samples used so far in the epoch are a whole number of the
new ranks' micro-steps, as they are at every optimizer step (the Trainer's resume maps it).

Map-style data keeps this small stream rather than torchdata's `StatefulDataLoader` (which
carries iterable data and a task's own loader, loader_stream.py): its position is one pair
of numbers shared by all ranks, so a resume starts at the saved sample without replaying
the epoch; a stateful loader's state is per rank and per world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import numpy as np
from torch.utils.data import DataLoader, Dataset, default_collate

from ddp_amp.data.order import GlobalOrder
from ddp_amp.distributed import to_device
from ddp_amp.errors import UsageError


def _holds_dataclass(value: Any) -> bool:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_dataclass(item) for item in value)
    if isinstance(value, Mapping):
        return any(_holds_dataclass(item) for item in value.values())
    return False


def collate(items: list[Any]) -> Any:
    """torch's `default_collate`, which also takes dataclass items: collated field by field into
    one dataclass of batched fields (default_collate refuses them)."""
    first = items[0]
    if not _holds_dataclass(first):
        return default_collate(items)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):  # an instance, as items are
        return dataclasses.replace(first, **{f.name: collate([getattr(item, f.name) for item in items])
                                              for f in dataclasses.fields(first) if f.init})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(collate(list(group)) for group in zip(*items)))
    if isinstance(first, (tuple, list)):
        return [collate(list(group)) for group in zip(*items)]  # as default_collate does
    return {key: collate([item[key] for item in items]) for key in first}


class RankShare:
    """The dataset indices one rank's loader draws in one epoch, from micro-batch `first` on:
    an iterable computed a micro-batch at a time (a DataLoader's sampler), never a list."""

    def __init__(self, order: GlobalOrder | None, epoch: int, rank: int, ranks: int, micro_batch_size: int,
                 first: int, batches: int) -> None:
        self.order, self.epoch, self.rank, self.ranks = order, epoch, rank, ranks
        self.micro_batch_size, self.first, self.batches = micro_batch_size, first, batches

    def __len__(self) -> int:
        return (self.batches - self.first) * self.micro_batch_size

    def positions(self, batch: int) -> tuple[int, int]:
        """(first position, count) of micro-batch `batch` in the epoch's order."""
        return (batch * self.ranks + self.rank) * self.micro_batch_size, self.micro_batch_size

    def __iter__(self) -> Iterator[int]:
        for batch in range(self.first, self.batches):
            start, count = self.positions(batch)
            indices = self.order.take(self.epoch, start, count) if self.order is not None else \
                np.arange(start, start + count)
            yield from indices.tolist()


class BatchStream:
    """Micro-batches for one rank, epoch after epoch, starting at a saved position; `rank`
    and `world_size` are the data-parallel rank and size (`DistContext.dp_rank`, `dp_size`),
    `samples_per_step` the global batch (default: one micro-batch on each rank)."""

    per_rank_position = False  # one position, the same on every rank (stream.py)

    def __init__(self, dataset: Dataset, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, device: torch.device, num_workers: int = 0, shuffle: bool = True,
                 worker_init_fn: Callable[[int], None] | None = None, samples_per_step: int = 0) -> None:
        self.dataset = dataset
        self.worker_init_fn = worker_init_fn
        self.micro_batch_size = micro_batch_size
        self.device = device
        self.num_workers = num_workers
        self.rank, self.world_size, self.seed = rank, world_size, seed
        size = len(dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__; a map-style one has it
        step = samples_per_step or micro_batch_size * world_size
        # Whole optimizer steps per epoch, so every rank's share has the same length (no rank
        # waits on a collective another never reaches) and an epoch ends at the same step on
        # any world size.
        self.samples_per_epoch = size - size % step
        self.batches_per_epoch = self.samples_per_epoch // (micro_batch_size * world_size)
        if self.batches_per_epoch < 1:
            raise UsageError("--batch-size", step, f"at most the dataset size ({size})",
                             "lower --batch-size or use a larger dataset")
        self.order = GlobalOrder(size, seed) if shuffle else None
        self.epoch = 0
        self.batch_in_epoch = 0
        self._iterator: Iterator[Any] | None = None

    def state_dict(self) -> dict[str, int]:
        """Position of the next micro-batch to be drawn."""
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self._iterator = None

    def _start_epoch(self) -> Iterator[Any]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):  # a mixture picks which windows of a partly used source this epoch holds
            set_epoch(self.epoch)
        share = RankShare(self.order, self.epoch, self.rank, self.world_size, self.micro_batch_size,
                          self.batch_in_epoch, self.batches_per_epoch)
        # A generator of its own: creating a loader iterator draws a base seed, and from the
        # global RNG that draw would make a resumed run's dropout differ from a straight one.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.rank) * 1_000_003 + self.epoch)
        loader = DataLoader(self.dataset, batch_size=self.micro_batch_size, sampler=share,
                            drop_last=True, num_workers=self.num_workers,
                            pin_memory=self.device.type == "cuda", generator=generator, collate_fn=collate,
                            worker_init_fn=self.worker_init_fn)
        return iter(loader)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Any:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._iterator = None
        if self._iterator is None:
            self._iterator = self._start_epoch()
        batch = next(self._iterator)
        self.batch_in_epoch += 1
        return to_device(batch, self.device)
