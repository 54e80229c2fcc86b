"""An endless stream of one rank's micro-batches over passes of a stateful loader, resumed
exactly from the loader's own state (torchdata's `StatefulDataLoader`, or any loader with
`state_dict()` / `load_state_dict()`).

It carries an iterable dataset (`iterable_stream.py` builds the loader) and a task's own
loader (`Task.make_loader`). Each rank's position is its own: a checkpoint holds every
rank's, and a resume needs the world size it was saved with.

A pass ends when the loader is exhausted; before each pass the stream calls `set_epoch(pass)`
on the loader's sampler, its batch sampler's sampler and its dataset, where they have one
(a `DistributedSampler`, a streaming dataset), so a shuffle differs per pass and is the same
again on a resume.

The global CPU RNG is left as it was by every call into the loader: a DataLoader without a
generator of its own draws its base seed from it when an iterator is made (and torchdata's
`state_dict()` may make one). A resumed run makes that iterator at another step than an
uninterrupted one, so the draw would shift every later dropout mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ddp_amp.distributed import to_device
from ddp_amp.errors import UsageError


def _epoch_setters(loader: Any) -> list[Any]:
    """The parts of `loader` that take `set_epoch`, each once."""
    found: dict[int, Any] = {}
    for part in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None),
                 getattr(loader, "dataset", None)):
        if callable(getattr(part, "set_epoch", None)):
            found.setdefault(id(part), part)
    return list(found.values())


def loader_length(loader: Any) -> int | None:
    """Batches per pass, where the loader knows it (a map-style dataset); None for a stream."""
    try:
        return len(loader)
    except TypeError:
        return None


class LoaderStream:
    """Micro-batches for one rank, pass after pass, from `loader`, moved to `device`."""

    per_rank_position = True  # a checkpoint keeps every rank's position (stream.py)

    def __init__(self, loader: Iterable[Any], micro_batch_size: int, device: torch.device, source: str,
                 batches_per_epoch: int | None = None) -> None:
        """`source` names where the loader came from, for the error an empty pass raises;
        `batches_per_epoch`: the pass's length where it is known and the same on every rank."""
        self.loader, self.micro_batch_size, self.device, self.source = loader, micro_batch_size, device, source
        self.batches_per_epoch = batches_per_epoch
        self._epoch_setters = _epoch_setters(loader)
        self.epoch = 0
        self.batch_in_epoch = 0
        self._iterator: Iterator[Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Where the next micro-batch comes from: the pass, and the loader's own state."""
        with torch.random.fork_rng(devices=[]):
            loader_state = self.loader.state_dict()  # type: ignore[attr-defined]  # checked when built
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "loader": loader_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        with torch.random.fork_rng(devices=[]):
            self.loader.load_state_dict(state["loader"])  # type: ignore[attr-defined]  # checked when built
        self._iterator = None

    def __iter__(self) -> LoaderStream:
        return self

    def _next_raw(self) -> Any:
        if self._iterator is None:
            for part in self._epoch_setters:
                part.set_epoch(self.epoch)
            with torch.random.fork_rng(devices=[]):
                self._iterator = iter(self.loader)
        return next(self._iterator)

    def __next__(self) -> Any:
        try:
            batch = self._next_raw()
        except StopIteration:  # this rank's share of the pass is used up: the next pass
            if self.batch_in_epoch == 0:
                raise UsageError(self.source, "an empty pass", "at least one micro-batch per rank and pass",
                                 "check the data's source and sharding, or lower --batch-size") from None
            self.epoch, self.batch_in_epoch, self._iterator = self.epoch + 1, 0, None
            batch = self._next_raw()
        self.batch_in_epoch += 1
        return to_device(batch, self.device)
