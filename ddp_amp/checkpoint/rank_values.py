"""A checkpoint's per-rank entries: each rank writes its own values and reads back only its own.

`Session.save(per_rank=...)` keeps values that differ per rank (the Trainer's data position
where each rank's differs, a task's `Task.state`). Each rank writes its own into one file,

    <checkpoint>/per_rank/rank-NNNNN.pt   {key: this rank's value}

beside its RNG file, hashed as it is written and listed in its record (rank_files.py), so the
manifest's digest pins it; on resume each rank reads only its own. Nothing a rank writes or
reads for them grows with the number of ranks, and rank 0 reads no other rank's. How many
ranks saved them is the manifest's count of ranks' records: a resume that needs each rank's
own value compares it with its world size without opening another rank's file.

Checkpoints written before held each per-rank entry in one file of rank 0's, every rank's
value in it (`data.pt`: {"ranks": [rank 0's, ...]}); they still load, read whole
(layout.py's `saved_state`).

Before anything is written, every rank checks that its values will load back; one
all-reduce of the lowest refusing rank, and, only where one refused, a broadcast of its
error, raise that error on every rank (`agree_loadable`): a fixed-size agreement, not a
gather of every rank's answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.checkpoint.safe_types import check_loadable, safe_load
from ddp_amp.distributed import broadcast_object, has_peers, mark_agreed
from ddp_amp.errors import UsageError

PER_RANK_DIR = "per_rank"


def per_rank_file(rank: int) -> str:
    """The checkpoint-relative name of rank `rank`'s file of per-rank values."""
    return f"{PER_RANK_DIR}/rank-{rank:05d}.pt"


def _refusal(values: Mapping[str, Any]) -> UsageError | None:
    try:
        for key, value in values.items():
            check_loadable(f"per_rank[{key!r}]", value)
    except UsageError as error:
        return error
    return None


def agree_loadable(values: Mapping[str, Any], device: torch.device) -> None:
    """Raise, on every rank, the UsageError of the lowest rank whose `values` would not load
    back; return where every rank's would (collective: one all-reduce, and a broadcast only
    where a rank refused; the all-reduce's tensor lives on `device`, as its backend wants)."""
    refusal = _refusal(values)
    if not has_peers():
        if refusal is not None:
            raise refusal
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lowest = torch.tensor([rank if refusal is not None else world_size], dtype=torch.int64, device=device)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    origin = int(lowest.item())
    if origin == world_size:
        return
    error = broadcast_object(refusal if rank == origin else None, src=origin)
    raise mark_agreed(error if error is not None else RuntimeError(f"rank {origin} refused its per-rank values"),
                      origin)


def read_own_values(directory: Path, rank: int | None, saved_ranks: int) -> dict[str, Any]:
    """Rank `rank`'s per-rank values in checkpoint `directory` ({} for None, or for a rank
    beyond the `saved_ranks` that saved some)."""
    if rank is None or rank >= saved_ranks:
        return {}
    values = safe_load(directory / per_rank_file(rank))
    if not isinstance(values, dict):
        raise UsageError("checkpoint file", str(directory / per_rank_file(rank)), "a rank's per-rank values (a dict)",
                         f"it holds a {type(values).__name__}; the checkpoint is not one ddp_amp wrote")
    return values
