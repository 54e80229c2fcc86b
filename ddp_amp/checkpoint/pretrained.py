"""Pretrained weights into a model, by name, each rank reading only what it holds: `--init-weights`.

A source is a `.safetensors` file, or a directory with `model.safetensors.index.json` (a
Hugging Face checkpoint split in several files: the index maps each name to its file) or one
`model.safetensors`. Names are the user's module's state-dict names, as `save_pretrained`
writes them. A sharded parameter (a DTensor, `Shard(0)` on the mesh's sharding dimension,
replicated across HSDP's replicas) is filled from the rows this rank holds: safetensors
reads a slice of a tensor without reading the rest, so a rank of N reads about 1/N of the
weights. A plain parameter reads its whole tensor.

Strict by default: a name of the model that no file has (missing), a name in the files the
model lacks (unexpected) or a shape that differs is a one-line UsageError naming the first
and how many. A parameter with several names (tied weights: an LM head that is its
embedding) is satisfied by any of them, as `save_pretrained` writes a tied weight once.
`strict=False` loads what matches and leaves the rest as initialised.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_amp.errors import UsageError
from ddp_amp.torch_api import DTensor, compute_local_shape_and_global_offset

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLAG = "--init-weights"
INSTALL_HINT = "pip install safetensors (or 'ddp_amp[export]')"


def weight_files(source: str | Path) -> dict[str, Path]:
    """Every tensor name of `source` and the file that holds it; a one-line UsageError for a
    source that is none of the three layouts."""
    path = Path(source)
    safe_open = _safe_open()
    if path.is_dir():
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise UsageError(FLAG, str(path / INDEX), "a Hugging Face index with a weight_map",
                                 f"it does not parse as one ({error}); write it with save_pretrained") from None
            return {name: path / file for name, file in weight_map.items()}
        if (path / SINGLE).is_file():
            path = path / SINGLE
        else:
            raise UsageError(FLAG, str(source), f"a .safetensors file, or a directory with {INDEX} or {SINGLE}",
                             "point it at the directory save_pretrained wrote, or at one .safetensors file")
    elif not path.is_file():
        raise UsageError(FLAG, str(source), "an existing .safetensors file or directory",
                         "check the path (a Hugging Face model directory, or a .safetensors file)")
    try:
        with safe_open(str(path), framework="pt") as opened:
            return {name: path for name in opened.keys()}  # noqa: SIM118  # a safetensors handle, not a dict
    except Exception as error:  # noqa: BLE001  # safetensors raises its own error types for a bad file
        raise UsageError(FLAG, str(path), "a readable .safetensors file",
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise UsageError(FLAG, "safetensors", "the safetensors package installed", INSTALL_HINT) from None
    return safe_open


@dataclass(frozen=True)
class LoadedWeights:
    """What `load_pretrained` did on this rank."""

    tensors: int  # model tensors filled
    bytes_read: int  # bytes this rank read from the files
    missing: tuple[str, ...] = ()  # names left as initialised (strict=False only)
    unexpected: tuple[str, ...] = ()  # names of the files the model has not (strict=False only)


def load_pretrained(model: nn.Module, source: str | Path, strict: bool = True) -> LoadedWeights:
    """Fill `model`'s parameters and persistent buffers from `source` by name (no collective:
    each rank reads its own slices); see the module's docstring."""
    files = weight_files(source)
    groups = _tensor_groups(model)
    chosen: dict[str, tuple[str, torch.Tensor]] = {}  # file name -> (model name, tensor)
    missing: list[str] = []
    for names, tensor in groups:
        found = next((name for name in names if name in files), None)
        if found is None:
            missing.append(names[0])
        else:
            chosen[found] = (names[0], tensor)
    known = {name for names, _ in groups for name in names}
    unexpected = sorted(name for name in files if name not in known)
    if strict and missing:
        raise _mismatch("missing", missing, "a weight for every parameter and persistent buffer of the model",
                        "the files lack these names; pass --no-init-weights-strict to keep their init")
    if strict and unexpected:
        raise _mismatch("unexpected", unexpected, "only names the model has",
                        "the files hold weights the model lacks (another architecture or config?); "
                        "--no-init-weights-strict ignores them")
    read = 0
    with ExitStack() as stack, torch.no_grad():
        safe_open = _safe_open()
        opened = {path: stack.enter_context(safe_open(str(path), framework="pt"))
                  for path in {files[name] for name in chosen}}
        for file_name, (model_name, tensor) in chosen.items():  # every shape before any copy: all or nothing
            shape = tuple(opened[files[file_name]].get_slice(file_name).get_shape())
            if shape != tuple(tensor.shape):
                raise UsageError(FLAG, file_name, f"shape {tuple(tensor.shape)} as the model's {model_name}",
                                 f"the file's is {shape}: another model size or config")
        for file_name, (_, tensor) in chosen.items():
            read += _fill(tensor, opened[files[file_name]], file_name)
    return LoadedWeights(len(chosen), read, tuple(missing), tuple(unexpected))


def _tensor_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each parameter and persistent buffer once, with every name it goes by (tied weights)."""
    by_identity: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            by_identity.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(by_identity.values())


def _fill(tensor: torch.Tensor, opened: Any, file_name: str) -> int:
    """Copy this rank's part of `file_name` (in the open safetensors file) into `tensor`; the bytes read."""
    stored = opened.get_slice(file_name)
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                    tensor.placements)
        if local.numel() == 0:
            return 0
        part = stored[tuple(slice(start, start + size) for start, size in zip(offset, local_shape))]
        local.copy_(part)
        return part.numel() * part.element_size()
    whole = opened.get_tensor(file_name)
    tensor.copy_(whole)
    return whole.numel() * whole.element_size()


def _mismatch(kind: str, names: list[str], expected: str, hint: str) -> UsageError:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return UsageError(f"{FLAG} ({kind})", names[0] + more, expected, hint)
