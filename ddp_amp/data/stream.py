"""The one contract every training stream keeps: what the Trainer, its checkpoints, its
resume and its LR schedules ask of the data.

A stream is endless: `next(stream)` is this rank's next micro-batch, on the run's device,
and a pass over the data (an epoch) turns over inside it. Its position is
(`epoch`, `batch_in_epoch`) plus whatever the loader keeps; `state_dict()` is what a
checkpoint saves and `load_state_dict()` resumes at exactly that micro-batch.

`per_rank_position` says where the position lives: False where it is one pair of numbers
shared by every data-parallel rank (a map-style shard: a checkpoint keeps one, and a resume
maps it onto another number of ranks), True where each rank's is its own (a stateful
loader: a checkpoint keeps every rank's, and a resume needs the same world).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class Stream(Protocol):
    """This rank's endless, resumable stream of micro-batches. Its numbers are read, never
    set, from outside: a plain attribute keeps the contract."""

    @property
    def micro_batch_size(self) -> int:
        """Items in each micro-batch."""
        ...

    @property
    def batches_per_epoch(self) -> int | None:
        """Micro-batches per pass, where known and the same on every rank; else None."""
        ...

    @property
    def epoch(self) -> int:
        """The pass the next micro-batch comes from."""
        ...

    @property
    def batch_in_epoch(self) -> int:
        """Micro-batches already drawn in this pass."""
        ...

    @property
    def per_rank_position(self) -> bool:
        """Whether each rank's position is its own (see the module's docstring)."""
        ...

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]:
        """The position of the next micro-batch to be drawn."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the micro-batch `state` names."""
        ...
