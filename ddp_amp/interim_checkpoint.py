"""Interim single-file checkpoint behind `Session.save` / `Session.load`.

A stand-in until the `ddp_amp.checkpoint` package (commit protocol, manifest, retention,
RNG states) lands: one `torch.save` file of plain state, written by rank 0 to a
temporary file and renamed into place, so a crash mid-write never leaves a torn file where
a good one was. Loading uses `weights_only=True`: only tensors and plain containers.
Swapping this module for the checkpoint package changes no user-facing call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ddp_amp.errors import UsageError


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
