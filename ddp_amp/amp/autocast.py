"""The autocast-inside-forward wrapper that sits inside DDP.

Autocast state is thread-local: an autocast region entered around a call in the main thread
does not reach a forward that runs in another thread (DataParallel replicas, a user's
worker threads). Entering autocast inside the module's own forward makes it hold wherever
the forward runs. Placement: ``DDP(AutocastModule(user_model))``. The module holds the run's
`Precision`, whose `autocast()` is the one place ddp_amp enters autocast.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ddp_amp.amp.precision import Precision
from ddp_amp.errors import UsageError


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: _to_fp32(v) for k, v in value.items()}
        # A dict of its own class (a Hugging Face ModelOutput, read as `output.logits`) stays
        # that class: a shallow copy of it, its values replaced.
        converted = copy.copy(value)
        for key, item in value.items():
            converted[key] = _to_fp32(item)
        return converted
    return value


class AutocastModule(nn.Module):
    """Runs the wrapped module's forward under the precision's autocast, in whatever thread calls it."""

    def __init__(self, module: nn.Module, precision: Precision, cast_outputs_to_fp32: bool = False) -> None:
        if not isinstance(precision, Precision):
            raise UsageError("AutocastModule precision", repr(precision), "a ddp_amp Precision",
                             "e.g. AutocastModule(model, resolve_precision('fp16', torch.device('cuda')))")
        super().__init__()
        self.module = module
        self.precision = precision
        self.cast_outputs_to_fp32 = cast_outputs_to_fp32

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Where the caller's thread already runs in this autocast state (the Trainer enters
        # it around forward and loss, as the recipe does), the precision hands back a no-op.
        with self.precision.autocast():
            output = self.module(*args, **kwargs)
        return _to_fp32(output) if self.cast_outputs_to_fp32 else output

    def unwrap(self) -> nn.Module:
        """The user's module, as it was passed in."""
        return self.module

    def extra_repr(self) -> str:
        return f"precision={self.precision.name}, device_type={self.precision.device_type!r}"


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DDP, torch.compile and AutocastModule layers off to reach the user's module."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(model, AutocastModule):
            model = model.unwrap()
        elif isinstance(compiled := getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = compiled
        else:
            return model
