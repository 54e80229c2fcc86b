"""Weights out: a state dict as safetensors, one file (`export`) or a Hugging Face model
directory (`export --hf`).

safetensors stores tensors only, contiguous, no two sharing storage (`storable_tensors`):
a tied weight (an LM head that is its embedding) is written as its own copy under each
name, so that `load_state_dict(strict=True)` finds every name, and non-tensor entries are
left out. The file appears whole or not at all (temporary file, fsync, rename).

`transformers.AutoModelForCausalLM.from_pretrained(DIR)` reads `config.json` (the model's
configuration: its `model_type` picks the class) and the weights: `model.safetensors`, or,
past the shard size, `model-0000K-of-0000N.safetensors` files with
`model.safetensors.index.json` mapping each name to its file, the layout `save_pretrained`
writes and `--init-weights` reads (`weights_in`). A weight that is another's is written
there once, under its first name, as `save_pretrained` writes it (`tied_once`); the
configuration says it is tied.

The configuration is the run's record of its transformers model (hf/config.py), written
without its `TIED` entry, which is ddp_amp's own.
The directory appears whole or not at all (written under a temporary name, then renamed);
an existing one is replaced only when asked, and that is checked before anything is read.
Needs safetensors: `pip install 'ddp_amp[export]'`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ddp_amp.durable import fsync_dir, write_atomic
from ddp_amp.errors import UsageError
from ddp_amp.hf.config import TIED
from ddp_amp.hf.weights_in import INDEX, SINGLE

INSTALL_HINT = "pip install 'ddp_amp[export]'"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


# -- one safetensors file ------------------------------------------------------------


@dataclass
class ExportedTensors:
    """The state dict made storable by safetensors, and what had to change on the way."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)  # name -> earlier name with the same storage
    skipped: list[str] = field(default_factory=list)  # non-tensor entries (e.g. `_extra_state`)


def _storage_key(tensor: torch.Tensor) -> int | None:
    """Identifies the memory behind `tensor`; None for empty storage (nothing to share)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() and storage.data_ptr() else None


def storable_tensors(state: Mapping[str, Any]) -> ExportedTensors:
    """Tensors safetensors accepts: contiguous, no two sharing storage (the names are the
    unwrapped module's already: the session saves modules unwrapped).

    A tensor whose storage an earlier name already uses (tied weights) is written as its
    own copy: safetensors refuses aliases, and `load_state_dict(strict=True)` needs every
    name. Loading copies the same values into both names, which in a model that ties them
    are one Parameter, so the tie holds. Non-tensor entries are left out: safetensors
    stores tensors only.
    """
    result = ExportedTensors()
    owners: dict[int, str] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            result.skipped.append(name)
            continue
        tensor = value.detach()
        key = _storage_key(tensor)
        if key is not None and key in owners:
            result.shared[name] = owners[key]
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif key is not None:
            owners[key] = name
        result.tensors[name] = tensor.contiguous()
    return result


def require_safetensors() -> ModuleType:
    """`safetensors.torch`, or a one-line UsageError saying how to install it."""
    try:
        import safetensors.torch
    except ImportError:
        raise UsageError("package", "safetensors", "installed, to write .safetensors files",
                         INSTALL_HINT) from None
    return safetensors.torch


def write_safetensors(path: Path, exported: ExportedTensors, metadata: dict[str, str],
                      backend: ModuleType) -> int:
    """Serialize, then replace `path` atomically (temporary file, fsync, rename); returns bytes written."""
    try:
        data = backend.save(exported.tensors, metadata=metadata)
    except (ValueError, TypeError, RuntimeError) as error:  # e.g. a dtype it has no code for
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise UsageError("--to", str(path), "tensors safetensors can store", f"{reason}; nothing was "
                         "written") from None
    try:
        write_atomic(path, data)
    except OSError as error:
        raise UsageError("--to", str(path), "a writable location", f"{error.strerror or error}; "
                         "nothing was written") from None
    return len(data)


# -- a Hugging Face model directory ---------------------------------------------------


def tied_once(exported: ExportedTensors, recorded: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`exported`'s tensors with a tied weight once, under its first name, as save_pretrained
    writes it (the config ties it): sharing storage where the checkpoint kept the tie, named
    in the run's record (`recorded`, under `TIED`) where a sharded checkpoint holds it under
    each name."""
    tied = recorded.get(TIED, {})
    return {name: tensor for name, tensor in exported.tensors.items()
            if name not in exported.shared and not _same_as(tied.get(name), tensor, exported.tensors)}


def _same_as(name: str | None, tensor: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether `tensor` is a copy of `tensors[name]` (a tied weight's other name)."""
    return name is not None and name in tensors and torch.equal(tensors[name], tensor)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '20KiB' or a number of bytes; a one-line UsageError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UsageError("--max-shard-size", text, "a size such as 5GB, 500MB or 20KiB",
                         "the largest weights file to write; a bigger tensor gets a file of its own")
    return int(float(match.group(1)) * _UNITS[unit])


def plan_files(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names in each weights file, in order, none over `max_bytes` unless one tensor is."""
    files: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def check_hf_output(output: Path, force: bool) -> None:
    """Refuse an `--to` that is a file, or that exists without `force`: before any reading."""
    if output.exists() and not output.is_dir():
        raise UsageError("--to", str(output), "a directory path", "with --hf the output is a model directory")
    if output.exists() and not force:
        raise UsageError("--to", str(output), "a path with nothing there yet",
                         "pass --force to replace it, or choose another --to")


def write_hf_directory(output: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], max_bytes: int,
                       backend: ModuleType, force: bool, extra_files: dict[str, bytes] | None = None) -> list[str]:
    """Write the directory (see the module's docstring), with `extra_files` (a tokenizer's)
    beside the weights; the weights files' names."""
    check_hf_output(output, force)
    config = {key: value for key, value in config.items() if key != TIED}
    groups = plan_files(tensors, max_bytes)
    names = [SINGLE] if len(groups) == 1 else [f"model-{k:05d}-of-{len(groups):05d}.safetensors"
                                               for k in range(1, len(groups) + 1)]
    scratch = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        for name, data in (extra_files or {}).items():
            _write(scratch / name, data)
        _write(scratch / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        for file_name, group in zip(names, groups):
            _write(scratch / file_name, backend.save({name: tensors[name] for name in group},
                                                     metadata={"format": "pt"}))
        if len(groups) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: file for file, group in zip(names, groups) for name in group}}
            _write(scratch / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        fsync_dir(scratch)
        _replace(scratch, output)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return names


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _replace(scratch: Path, output: Path) -> None:
    """Rename `scratch` to `output`; an existing `output` is moved aside first and removed after."""
    aside = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        os.replace(output, aside)
    os.replace(scratch, output)
    fsync_dir(output.parent)
    shutil.rmtree(aside, ignore_errors=True)
