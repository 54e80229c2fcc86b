"""The autocast-inside-forward wrapper that sits inside DDP.

Autocast state is thread-local: `with torch.autocast(...)` around a call in the main thread
does not reach a forward that runs in another thread (DataParallel replicas, a user's
worker threads). Entering autocast inside the module's own forward makes it hold wherever
the forward runs. Placement: ``DDP(AutocastModule(user_model))``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


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
    """Runs the wrapped module's forward under `torch.autocast(device_type, dtype)`."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype,
                 enabled: bool = True, cast_outputs_to_fp32: bool = False) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype
        self.enabled = enabled
        self.cast_outputs_to_fp32 = cast_outputs_to_fp32

    def _already_in_effect(self) -> bool:
        """Does this thread already run under the autocast this module asks for?"""
        if not torch.is_autocast_enabled(self.device_type):
            return not self.enabled
        return self.enabled and torch.get_autocast_dtype(self.device_type) == self.dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Where the caller's thread is already in the same autocast state (the Trainer runs
        # forward and loss in one region, as the recipe does), entering it again would only
        # cost host time; any other thread, or another state, gets this module's own.
        if self._already_in_effect():
            output = self.module(*args, **kwargs)
        else:
            with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
                output = self.module(*args, **kwargs)
        return _to_fp32(output) if self.cast_outputs_to_fp32 else output

    def unwrap(self) -> nn.Module:
        """The user's module, as it was passed in."""
        return self.module

    def extra_repr(self) -> str:
        return f"device_type={self.device_type!r}, dtype={self.dtype}, enabled={self.enabled}"


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DDP, torch.compile and AutocastModule layers off to reach the user's module."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(model, AutocastModule):
            model = model.unwrap()
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model
