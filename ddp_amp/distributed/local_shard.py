"""This rank's part of a tensor that may be sharded over the ranks (a DTensor).

Code that reads parameters or gradients on one rank (the finite and forensics guards, the
memory benchmark) reads the local shard of a sharded one and all of a plain one; the
check sits here, below whatever sharded them, so such code needs no knowledge of sharding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a sharded one's (DTensor's) local shard, else all of it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_numel_bytes(tensors: Iterable[Any]) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard only)."""
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            local = local_part(tensor)
            total += local.numel() * local.element_size()
    return total
