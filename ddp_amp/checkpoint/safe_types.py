"""What a checkpoint may hold: the types `torch.load(weights_only=True)` reads back here.

Loading never runs pickled code: weights_only accepts tensors and plain containers, plus
the classes allow-listed below, which users' training state commonly holds (a numpy step
counter, a `Path` to the data) and which rebuild as data, not code. `check_loadable`
runs the same restricted loader on the state's shape (tensors replaced by empty ones)
before anything is written, so what save accepts, load accepts: a state that load would
refuse fails the save, naming the entry, and the previous checkpoint stays in place.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddp_amp.errors import UsageError
from ddp_amp.torch_api import safe_globals

try:  # numpy 2 moved its internals to numpy._core; numpy 1 has numpy.core
    from numpy._core import multiarray as _multiarray
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]  # the same module, numpy 1's path

_NUMPY_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                 np.uint64, np.float16, np.float32, np.float64)
SAFE_GLOBALS: list[Any] = [
    pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
    np.dtype, np.ndarray, _multiarray.scalar, _multiarray._reconstruct,
    *dict.fromkeys(type(np.dtype(kind)) for kind in _NUMPY_DTYPES),
]


def safe_load(source: Path | io.BytesIO) -> Any:
    """`torch.load(weights_only=True)` to the CPU with the allow-list; refusals are UsageErrors."""
    try:
        with safe_globals(SAFE_GLOBALS):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0][:200]
        raise UsageError("checkpoint file", str(source), "tensors and plain containers only",
                         f"it holds pickled objects or code, refused unexecuted ({reason}); "
                         "only resume from checkpoints you trust, saved by ddp_amp") from None


def _shape_of(value: Any) -> Any:
    """`value` with every tensor replaced by an empty one of its dtype: cheap to pickle."""
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    if type(value) in (dict, OrderedDict):
        return type(value)((key, _shape_of(item)) for key, item in value.items())
    if type(value) in (list, tuple):
        return type(value)(_shape_of(item) for item in value)
    return value


def check_loadable(name: str, value: Any) -> None:
    """Raise UsageError unless `value` survives torch.save and the restricted load above."""
    buffer = io.BytesIO()
    try:
        torch.save(_shape_of(value), buffer)
        buffer.seek(0)
        with safe_globals(SAFE_GLOBALS):
            torch.load(buffer, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickling and unpickling fail in many ways
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise UsageError("checkpoint entry", name, "tensors, numbers, strings, paths, numpy values "
                         "and lists/tuples/dicts of them (what a safe load reads back)",
                         f"{reason}; save its state_dict() or plain values instead") from None
