"""This rank's part of a tensor that may be sharded over the ranks (a DTensor), and whether a
model was sharded.

Code that reads parameters or gradients on one rank (the finite and forensics guards, the
memory benchmark, checkpoints) reads the local shard of a sharded one and all of a plain
one; the checks sit here, below whatever sharded them, so such code needs no knowledge of
how it was sharded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ddp_amp.torch_api import DTensor, FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` (or a module inside it) was sharded with fully_shard."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


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
