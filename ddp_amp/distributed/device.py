"""This rank's device: which one it is, and moving batches onto it."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError, spelled

# auto, cuda or cpu (the command line's choices); a script may also name one GPU, "cuda:1"
# or torch.device("cuda", 1).
DeviceChoice = Literal["auto", "cuda", "cpu"] | str | torch.device


def resolve_device(choice: DeviceChoice, env: DistEnv, backend: str = "auto", name: str = "--device") -> torch.device:
    """Pick this rank's device: the GPU of its local rank, the one GPU named ("cuda:1"), or
    the CPU; messages call the option `name` (a flag, or a keyword of the caller's)."""
    kind, index = _parse(choice, name)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(name, str(choice), "a machine with a CUDA GPU",
                         f"use {spelled(name, 'cpu')} or {spelled(name, 'auto')}")
    count = torch.cuda.device_count()
    if index is not None:
        # Named by the caller, each rank its own (f"cuda:{local_rank}"): taken as it is.
        if index >= count:
            raise UsageError(name, str(choice), f"a visible GPU, cuda:0 to cuda:{count - 1}",
                             f"{spelled(name, 'cuda')} takes the GPU of this process's local rank")
        return torch.device("cuda", index)
    # Checked against the node's process count, not this rank's index, so that every rank
    # of the node fails alike and rank 0 prints the line: a check on LOCAL_RANK failed only
    # the ranks past the last GPU, and rank 0, the one that prints, went on to wait for them.
    if env.local_world_size > count and backend != "gloo":
        raise UsageError("LOCAL_WORLD_SIZE", env.local_world_size, f"<= {count} visible GPU(s), one process each",
                         "start one process per GPU (--nproc_per_node / --ntasks-per-node), "
                         "or use --backend gloo to share GPUs")
    return torch.device("cuda", env.local_rank % count)


def _parse(choice: DeviceChoice, name: str) -> tuple[str, int | None]:
    """(auto | cpu | cuda, the GPU's index where one is named) of a device's spelling."""
    if isinstance(choice, str) and choice == "auto":
        return "auto", None
    try:
        device = torch.device(choice)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(name, str(choice), "one of auto, cuda, cpu, or one GPU as cuda:N",
                         "auto picks cuda when a GPU is visible")
    return device.type, device.index if device.type == "cuda" else None


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors to `device` without blocking, field by field through tuples, namedtuples,
    lists, dicts and dataclasses (which keep their types, dicts become plain dicts); anything else is
    left as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields by position
        return type(batch)(*(to_device(item, device) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        moved = {f.name: to_device(getattr(batch, f.name), device) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **moved)
    return batch
