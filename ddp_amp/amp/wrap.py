"""How a user's model is wrapped for training: `DDP(AutocastModule(torch.compile(model)))`, or
sharded, `AutocastModule(fully_shard(model))`.

Compiling the user's module alone keeps autocast and DDP's hooks outside the compiled
graph, so the compiled code sees plain tensors and autocast stays the wrapper's job
(thread-local, see autocast.py). The wrapper sits inside DDP so that DDP's forward, in
whatever thread calls it, runs the user's forward under autocast. A world of one gets the
AutocastModule alone. Sharded (FSDP2), the model itself is the FSDP root, so the wrapper sits
outside it: autocast is entered before the root gathers its weights, and the sharded state's
names are the model's own. `Session.setup` builds every model here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddp_amp.amp.autocast import AutocastModule
from ddp_amp.amp.float8 import convert_linears
from ddp_amp.amp.precision import Precision
from ddp_amp.distributed import CommHook, ShardOptions, Units, shard_model, shard_units, wrap_ddp


def wrap_model(model: nn.Module, precision: Precision, device: torch.device, *, distributed: bool,
               compile_model: bool = False, cast_outputs_to_fp32: bool = False,
               comm_hook: CommHook | None = None, shard: ShardOptions | None = None, units: Units = None,
               **ddp_options: Any) -> nn.Module:
    """Move `model` to `device` and wrap it (collective when `distributed`: DDP's broadcast,
    or sharding's agreement).

    `comm_hook` and `ddp_options` (static_graph, find_unused_parameters, ...) go to DDP;
    with `shard`, the model is sharded instead, by `units` (`distributed.shard_units`).
    """
    inner = model.to(device)
    if precision.float8_linears:  # before compiling, so the float8 casts are compiled too
        inner = convert_linears(inner, emulate=precision.emulate_fp8)
    if shard is not None:
        inner = shard_model(inner, shard_units(inner, units), shard)
        return AutocastModule(inner, precision, cast_outputs_to_fp32=cast_outputs_to_fp32)
    if compile_model:
        inner = torch.compile(inner)
    wrapped = AutocastModule(inner, precision, cast_outputs_to_fp32=cast_outputs_to_fp32)
    if not distributed:
        return wrapped
    return wrap_ddp(wrapped, device, comm_hook=comm_hook, **ddp_options)
