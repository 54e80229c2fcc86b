"""DDP itself: the one place a model is wrapped in DistributedDataParallel, and its comm hook.

DDP takes one communication hook, registered before the first backward; `wrap_ddp`
registers it at construction, so no other module touches `register_comm_hook`. The only
hook is `--grad-comm-dtype`'s compression (`comm_hook`): without one DDP keeps its built-in
C++ all-reduce, since a Python hook costs host time on every bucket of every step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp.errors import UsageError
from ddp_amp.parallel.plan import COMM_DTYPES

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

# Compression hooks cast each bucket, all-reduce it in the small dtype and cast back.
# torch's own hooks serve NCCL; its bf16 hook refuses other backends, though gloo sums bf16 fine.
_NCCL_HOOKS: dict[str, CommHook] = {"fp16": default_hooks.fp16_compress_hook,
                                    "bf16": default_hooks.bf16_compress_hook}


def _cast_hook(dtype: torch.dtype) -> CommHook:
    """A comm hook that averages each bucket in `dtype` (for backends other than NCCL)."""
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        # Divide before the sum so the small dtype holds the mean, not the larger total.
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def back_to_buffer(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer
        return future.then(back_to_buffer)
    # DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
    hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


def comm_hook(grad_comm_dtype: str, backend: str = "gloo") -> CommHook | None:
    """The DDP comm hook for `--grad-comm-dtype`, or None for DDP's own fp32 all-reduce."""
    if grad_comm_dtype not in COMM_DTYPES:
        raise UsageError("--grad-comm-dtype", grad_comm_dtype, "one of " + ", ".join(COMM_DTYPES), "")
    dtype = COMM_DTYPES[grad_comm_dtype]
    if dtype is None:
        return None
    return _NCCL_HOOKS[grad_comm_dtype] if backend == "nccl" else _cast_hook(dtype)


def wrap_ddp(module: nn.Module, device: torch.device, *, comm_hook: CommHook | None = None,
             gradient_as_bucket_view: bool = True, static_graph: bool = False,
             **ddp_options: Any) -> DDP:
    """`DDP(module)` on `device` with `comm_hook` registered (collective: DDP broadcasts weights).

    `gradient_as_bucket_view`: gradients as views into DDP's buckets save one copy per step
    and the memory of a second set of gradients; valid because nobody keeps `.grad` across
    steps. Other keywords (find_unused_parameters, bucket_cap_mb, ...) go to DDP.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(module, device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view,
              static_graph=static_graph, **ddp_options)
    if comm_hook is not None:
        ddp.register_comm_hook(state=None, hook=comm_hook)
    return ddp


def release_ddp(model: DDP) -> None:
    """Drop a still-referenced DDP wrapper's hold on the process group before the group goes.

    The reducer and its logger keep the group alive; destroyed later (at interpreter exit)
    gloo's destructor can abort or hang the process. The wrapper is unusable afterwards,
    as any DDP model is once its group is gone.
    """
    for name in ("logger", "reducer", "process_group"):
        model.__dict__.pop(name, None)
    gc.collect()
