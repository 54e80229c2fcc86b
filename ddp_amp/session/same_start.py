"""Every rank starts from rank 0's weights: the user's module's parameters and buffers,
broadcast from rank 0 before a sharded `setup`.

DDP does this when it is constructed, so a replicated model never needed it; FSDP2's
`fully_shard` does not: each rank keeps its own slice of whatever it initialised. A
script that seeds each rank differently (for different dropout masks, say) would then
train a patchwork of inits, silently. One broadcast per tensor at setup time costs what
DDP's costs and nothing per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_from_rank_zero(module: nn.Module) -> None:
    """Overwrite `module`'s parameters and buffers with rank 0's, in place (collective).

    Every rank calls it with the same module structure, on its device; tensors on the meta
    device (not yet materialised) hold no values and are left alone, on every rank alike.
    """
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            if not tensor.is_meta:
                dist.broadcast(tensor.data, src=0)
