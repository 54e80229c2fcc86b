"""An endless, resumable stream of per-rank micro-batches of a map-style dataset, over epochs.

Each epoch draws its order from a `DistributedSampler` with `set_epoch(epoch)` over the
data-parallel ranks, so every data-parallel rank sees a disjoint shard (ranks that share a
data-parallel rank see the same one), and the order changes per epoch but is the same for
a given seed. The position (epoch, micro-batch within the epoch) is part of a checkpoint, and
`load_state_dict` resumes at exactly that micro-batch.

Map-style data keeps this small stream rather than torchdata's `StatefulDataLoader` (which
carries iterable data and a task's own loader, loader_stream.py): its position is one pair
of numbers shared by all ranks, so a resume starts at the saved sample without replaying
the epoch, and maps onto another number of data-parallel ranks where the sample count
divides (the Trainer's resume maps it); a stateful loader's state is per rank and per world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

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


class BatchStream:
    """Micro-batches for one rank, epoch after epoch, starting at a saved position; `rank`
    and `world_size` are the data-parallel rank and size (`DistContext.dp_rank`, `dp_size`)."""

    per_rank_position = False  # one position, the same on every rank (stream.py)

    def __init__(self, dataset: Dataset, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, device: torch.device, num_workers: int = 0, shuffle: bool = True,
                 worker_init_fn: Callable[[int], None] | None = None) -> None:
        self.dataset = dataset
        self.worker_init_fn = worker_init_fn
        self.micro_batch_size = micro_batch_size
        self.device = device
        self.num_workers = num_workers
        # drop_last keeps every rank's shard the same length, so no rank waits on a
        # collective that another rank never reaches at the end of an epoch.
        self.sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                                                   shuffle=shuffle, seed=seed, drop_last=True)
        self.batches_per_epoch = len(self.sampler) // micro_batch_size
        if self.batches_per_epoch < 1:
            raise UsageError("--batch-size", micro_batch_size * world_size,
                             f"at most the dataset size ({len(dataset)}) per world",  # type: ignore[arg-type]  # torch's Dataset declares no __len__; a map-style one has it
                             "lower --batch-size or use a larger dataset")
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
        self.sampler.set_epoch(self.epoch)
        order = list(self.sampler)[self.batch_in_epoch * self.micro_batch_size:]
        # A generator of its own: creating a loader iterator draws a base seed, and from the
        # global RNG that draw would make a resumed run's dropout differ from a straight one.
        generator = torch.Generator().manual_seed(
            (self.sampler.seed * 1_000_003 + self.sampler.rank) * 1_000_003 + self.epoch)
        loader = DataLoader(self.dataset, batch_size=self.micro_batch_size, sampler=order,
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
