"""A checkpoint's state copied into host memory that the next training steps cannot change.

The optimizer step updates parameters and optimizer state in place, so a background write
of the live tensors would save a mix of several steps. `HostStaging.copy` makes a private
copy of a nested state (dicts, lists, tuples, tensors, numpy arrays):
- a CUDA tensor goes into a pinned host buffer, kept and reused by the next save of the
  same entry (pinning is slow; a model's buffers are the same every save), copied with
  `non_blocking=True`, and one synchronisation of each device's current stream at the end
  makes every copy complete before the copy is handed on;
- a CPU tensor is cloned, a numpy array copied;
- the same tensor under two names (tied weights) stays one tensor, so it is written once,
  as a save of the live state would write it.
Reusing a pinned buffer is safe only once the write that read it has finished: the caller
(`BackgroundSaver`) starts a copy only after the previous write is done.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

_Alias = tuple[Any, ...]
_Path = tuple[Hashable, ...]  # where an entry sits in the state: its pinned buffer's key


def _alias_key(tensor: torch.Tensor) -> _Alias:
    """What makes two tensors the same view of the same memory."""
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype)


class HostStaging:
    """Copies nested checkpoint state off the device, reusing pinned buffers across saves."""

    def __init__(self) -> None:
        self._pinned: dict[_Path, torch.Tensor] = {}

    def copy(self, state: Any) -> Any:
        """`state` with every tensor and array replaced by a private host copy."""
        copier = _Copier(self._pinned)
        staged = copier.copy(state, ())
        for device in copier.devices:  # the one wait: every non-blocking copy has landed
            torch.cuda.current_stream(device).synchronize()
        self._pinned = copier.pinned_used  # buffers of entries this save no longer has are let go
        return staged


class _Copier:
    """One `HostStaging.copy`: the buffers it may reuse, and what it copied so far."""

    def __init__(self, pinned: dict[_Path, torch.Tensor]) -> None:
        self.pinned = pinned
        self.pinned_used: dict[_Path, torch.Tensor] = {}
        self.copies: dict[_Alias, torch.Tensor] = {}
        self.devices: set[torch.device] = set()

    def copy(self, value: Any, path: _Path) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, np.ndarray):
            return value.copy()
        if isinstance(value, dict):
            return self.mapping(value, path)
        if isinstance(value, list):
            return [self.copy(item, (*path, index)) for index, item in enumerate(value)]
        if type(value) is tuple:
            return tuple(self.copy(item, (*path, index)) for index, item in enumerate(value))
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(self.copy(item, (*path, index)) for index, item in enumerate(value)))
        return value  # numbers, strings, paths, dtypes, torch.Size: immutable

    def mapping(self, value: dict[Any, Any], path: _Path) -> dict[Any, Any]:
        copied = {key: self.copy(item, (*path, key)) for key, item in value.items()}
        staged = copied if type(value) is dict else type(value)(copied)  # an OrderedDict stays one
        metadata = getattr(value, "_metadata", None)  # a state_dict's per-module versions
        if metadata is not None:
            staged._metadata = self.copy(metadata, (*path, "_metadata"))  # type: ignore[attr-defined]  # state_dict's attribute, unknown to dict
        return staged

    def tensor(self, tensor: torch.Tensor, path: _Path) -> torch.Tensor:
        alias = _alias_key(tensor)
        if alias in self.copies:
            return self.copies[alias]
        tensor = tensor.detach()
        if tensor.is_cuda and tensor.layout == torch.strided:
            staged = self.pinned_buffer(tensor, path)
            staged.copy_(tensor, non_blocking=True)
            self.devices.add(tensor.device)
        elif tensor.device.type == "cpu":
            staged = tensor.clone()
        else:  # another accelerator or layout: a plain blocking copy
            staged = tensor.to("cpu", copy=True)
        self.copies[alias] = staged
        return staged

    def pinned_buffer(self, tensor: torch.Tensor, path: _Path) -> torch.Tensor:
        buffer = self.pinned.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.pinned_used[path] = buffer
        return buffer
