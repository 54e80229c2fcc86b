"""What a session makes of a model, and what it remembers of the models it made.

`setup` wraps a model one of two ways: replicated, `DDP(AutocastModule(model))` (the
AutocastModule alone for a world of one); or sharded (`--shard`, FSDP2),
`AutocastModule(model)` with the model's blocks and then the model itself sharded in place.
Either way the user's own module is inside (`unwrap`), with the same parameters.

The session remembers its DDP wrappers (released before the group is torn down; a
`retain_graph` backward through one that syncs is refused) and its sharded models (whose
state and optimizer state a checkpoint writes sharded).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp.amp import AutocastModule, Precision, unwrap_model, wrap_model
from ddp_amp.distributed import DistContext, ShardOptions, Units, comm_hook, is_sharded, release_ddp
from ddp_amp.errors import UsageError

_COMM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class SessionModels:
    """The models one session set up: how each was wrapped, and what to do with them later."""

    def __init__(self, ctx: DistContext, precision: Precision, shard: ShardOptions | None) -> None:
        self.ctx, self.precision, self.shard = ctx, precision, shard
        self._ddp: list[weakref.ref[DDP]] = []
        self.sharded: list[nn.Module] = []  # the user's modules, sharded (FSDP roots)

    def setup(self, model: nn.Module, *, compile_model: bool, grad_comm_dtype: str, cast_outputs_to_fp32: bool,
              units: Units, ddp_options: dict[str, Any]) -> nn.Module:
        """Move `model` to the device and wrap it (collective); see `Session.setup`."""
        if isinstance(model, (DDP, AutocastModule)):
            raise UsageError("model", type(model).__name__, "the plain user module",
                             "pass the model before wrapping; setup adds AutocastModule and DDP")
        ctx = self.ctx
        if self.shard is not None:
            return self._sharded(model, compile_model, grad_comm_dtype, cast_outputs_to_fp32, units, ddp_options)
        # A Python comm hook only where compression needs one; else DDP's C++ all-reduce.
        hook = comm_hook(grad_comm_dtype, ctx.backend or "gloo") if ctx.has_group else None
        wrapped = wrap_model(model, self.precision, ctx.device, distributed=ctx.has_group, compile_model=compile_model,
                             cast_outputs_to_fp32=cast_outputs_to_fp32, comm_hook=hook, **ddp_options)
        if isinstance(wrapped, DDP):
            self._ddp.append(weakref.ref(wrapped))
        return wrapped

    def _sharded(self, model: nn.Module, compile_model: bool, grad_comm_dtype: str, cast_outputs_to_fp32: bool,
                 units: Units, ddp_options: dict[str, Any]) -> nn.Module:
        refused = ["compile_model"] if compile_model else []
        refused += [name for name, value in ddp_options.items() if value and name != "gradient_as_bucket_view"]
        if refused:
            raise UsageError("setup option", refused[0], "an option of a sharded model",
                             f"{refused[0]} is DDP's (or not supported with sharding yet); drop it, or drop sharding")
        if grad_comm_dtype not in _COMM_DTYPES:
            raise UsageError("--grad-comm-dtype", grad_comm_dtype, "one of " + ", ".join(_COMM_DTYPES), "")
        options = ShardOptions(self.shard.reshard_after_forward, self.shard.activation_checkpointing,  # type: ignore[union-attr]
                               _COMM_DTYPES[grad_comm_dtype])
        wrapped = wrap_model(model, self.precision, self.ctx.device, distributed=True, shard=options, units=units,
                             cast_outputs_to_fp32=cast_outputs_to_fp32)
        self.sharded.append(unwrap_model(wrapped))
        return wrapped

    def local_module(self, model: nn.Module) -> AutocastModule:
        """The AutocastModule of a set-up model (see `Session.local_module`)."""
        inner = model.module if isinstance(model, DDP) else model
        if not isinstance(inner, AutocastModule):
            raise UsageError("model", type(model).__name__, "a model returned by Session.setup",
                             "pass what session.setup(model) returned")
        return inner

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """No gradient reduction for the micro-batches in the block (see `Session.no_sync`)."""
        if isinstance(model, DDP):
            return model.no_sync()
        if is_sharded(unwrap_model(model)):
            return _sharded_no_sync(unwrap_model(model))
        return nullcontext()

    def synced_ddp(self) -> list[DDP]:
        """The DDP wrappers alive whose next backward reduces gradients."""
        models = (ref() for ref in self._ddp)
        return [m for m in models if m is not None and m.require_backward_grad_sync]

    def release(self) -> None:
        """Cut the DDP wrappers still alive from the group, before it is destroyed."""
        refs, self._ddp = self._ddp, []
        for ref in refs:
            model = ref()
            if model is not None:
                release_ddp(model)


@contextmanager
def _sharded_no_sync(root: nn.Module) -> Iterator[None]:
    # FSDP2 keeps the unsharded gradients of the block's backwards and reduce-scatters them
    # in the first backward outside it: the same sum as DDP's no_sync.
    root.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)  # type: ignore[operator]
