"""Interim single-file checkpoint behind `Session.save` / `Session.load`.

A stand-in until the `ddp_amp.checkpoint` package (commit protocol, manifest, retention,
RNG states) is wired in: one `torch.save` file of plain state, written by rank 0 to a
temporary file, fsynced and renamed into place, so a crash mid-write never leaves a torn
file where a good one was. Loading uses `weights_only=True`: tensors and plain containers
only. Swapping this module for the checkpoint package changes no user-facing call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_amp.autocast import unwrap_model
from ddp_amp.dist import broadcast_object
from ddp_amp.errors import UsageError

# The key under which the loss scaler is stored: the scale is training state too.
SCALER_KEY = "scaler"


def _state_of(value: Any) -> Any:
    if isinstance(value, nn.Module):
        return unwrap_model(value).state_dict()  # no `module.` prefixes from the wrappers
    if hasattr(value, "state_dict"):
        return value.state_dict()
    return value


def write_state_file(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically: temporary file, fsync, rename (one process only)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(scratch, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            # fsync before the rename: otherwise a power loss can leave the new name
            # pointing at a file whose data never reached the disk.
            os.fsync(handle.fileno())
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)


def read_state_file(path: str | os.PathLike[str], device: torch.device) -> dict[str, Any]:
    """Read a state file written by `write_state_file`, tensors mapped onto `device`."""
    source = Path(path)
    if not source.is_file():
        raise UsageError("checkpoint", str(source), "an existing checkpoint file",
                         "check the path; Session.save writes it")
    try:
        state = torch.load(source, map_location=device, weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure is a bad file
        raise UsageError("checkpoint", str(source), "a file written by Session.save",
                         f"it could not be read ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict):
        raise UsageError("checkpoint", str(source), "a dict of state", "it was written by something else")
    return state


def save(path: str | os.PathLike[str], state: Mapping[str, Any], scaler: torch.amp.GradScaler,
         is_main: bool) -> None:
    """Every rank calls it; rank 0 writes `state` (models unwrapped) plus the scaler (collective)."""
    if SCALER_KEY in state:
        raise UsageError("state key", SCALER_KEY, "a key other than the reserved one",
                         "the session saves its scaler under it; rename yours")
    payload = {key: _state_of(value) for key, value in state.items()}
    payload[SCALER_KEY] = scaler.state_dict()
    error = None
    if is_main:
        try:
            write_state_file(path, payload)
        except OSError as failure:
            error = f"{type(failure).__name__}: {failure}"
    # Every rank learns whether the write worked, and none returns before it is done.
    error = broadcast_object(error)
    if error is not None:
        raise UsageError("checkpoint path", str(path), "a writable location", str(error))


def load(path: str | os.PathLike[str], state: Mapping[str, Any], scaler: torch.amp.GradScaler,
         device: torch.device) -> dict[str, Any]:
    """Load a `save` file into the objects of `state` and into `scaler`; return the file."""
    payload = read_state_file(path, device)
    for key, target in state.items():
        if key not in payload:
            raise UsageError("checkpoint key", key, f"one of {sorted(payload)}",
                             "save it first, or leave it out of the load")
        if isinstance(target, nn.Module):
            unwrap_model(target).load_state_dict(payload[key])
        elif hasattr(target, "load_state_dict"):
            target.load_state_dict(payload[key])
    scaler_state = payload.get(SCALER_KEY) or {}
    if scaler.is_enabled() and scaler_state:  # a disabled scaler saves {}
        scaler.load_state_dict(scaler_state)
    return payload
