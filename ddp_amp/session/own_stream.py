"""A sharded build draws from rank 0's random stream; each rank's own stream moves on as
though the rank had built the model itself.

A plain build on rank r draws the model's init from r's stream and leaves it advanced by
those draws (DDP then takes rank 0's weights). A sharded build draws every rank's rows from
rank 0's stream, so that the rows are one model's; left at that, a rank seeded apart
(nanoGPT's `seed + rank`) would come out of the build where it went in, and draw other
batches and dropout masks afterwards than the same script under DDP.

`OwnStreamReplay(own)` closes the gap: inside it, each random op that draws from the global
CPU generator runs as asked, on the build's stream, and then once more on a scratch copy of
its operands, on the rank's own stream. The same ops in the same order draw the same count
of numbers (with the same cached normal samples) as the plain build's, so the own stream
ends where the plain build leaves it. The cost, on the ranks whose stream is not rank 0's
only: the build's random draws once more (about 5 ns a number on one CPU core), and while a
parameter is drawn, a second tensor of its full size to draw the replay into.
"""

from __future__ import annotations

from typing import Any

import torch

from ddp_amp.torch_api import TorchDispatchMode, tree_flatten, tree_map


def _draws_from_default_cpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> bool:
    """Whether `func` drew from the global CPU generator: a seeded op, given no generator
    of its own, whose tensors are on the CPU (meta tensors draw nothing, CUDA ones draw
    from the GPU's generator, which a sharded build does not swap)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    values, _ = tree_flatten((args, kwargs))
    if any(isinstance(value, torch.Generator) for value in values):
        return False
    tensors = [value for value in tree_flatten(result)[0] if isinstance(value, torch.Tensor)]
    return bool(tensors) and all(tensor.device.type == "cpu" for tensor in tensors)


def _scratch(value: Any) -> Any:
    """A plain CPU tensor to replay an op on: a copy of a plain tensor (the op may write into
    it, or read it); for any other (a parameter that holds only a rank's rows, which the build
    lets random fills overwrite only) an empty one of its full shape."""
    if not isinstance(value, torch.Tensor):
        return value
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return value.detach().clone()
    return torch.empty(value.shape, dtype=value.dtype)


class OwnStreamReplay(TorchDispatchMode):
    """Inside (`with`): every draw from the global CPU generator is made once more from the
    stream `own` (a `torch.get_rng_state()`); `own` is that stream, advanced, afterwards."""

    def __init__(self, own: torch.Tensor) -> None:
        super().__init__()
        self.own = own

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if _draws_from_default_cpu(func, args, kwargs, result):
            build = torch.get_rng_state()
            torch.set_rng_state(self.own)
            func(*tree_map(_scratch, args), **tree_map(_scratch, kwargs))
            self.own = torch.get_rng_state()
            torch.set_rng_state(build)
        return result
