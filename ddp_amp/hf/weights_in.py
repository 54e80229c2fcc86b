"""Pretrained weights into a model, by name, each rank reading only what it holds: `--init-weights`.

A source is a `.safetensors` file, or a directory with `model.safetensors.index.json` (a
Hugging Face checkpoint split in several files: the index maps each name to its file) or one
`model.safetensors`. Names are the user's module's state-dict names, as `save_pretrained`
writes them. A sharded parameter (a DTensor, `Shard(0)` on the mesh's sharding dimension,
replicated across HSDP's replicas) is filled from the rows this rank holds, read from the
file without reading the rest, so a rank of N reads about 1/N of the weights. A plain
parameter reads its whole tensor. The files are read, not mapped (`safetensors_file`): a
rank's resident set holds what it loads, not the file's pages as well.

Strict by default: a name of the model that no file has (missing), a name in the files the
model lacks (unexpected) or a shape that differs is a one-line UsageError naming the first
and how many. A parameter with several names (tied weights: an LM head that is its
embedding) is satisfied by any of them, as `save_pretrained` writes a tied weight once.
`strict=False` loads what matches and leaves the rest as initialised.

All of that is decided from the files' headers (`read_headers`: every file there, whole,
each name's shape) and the model's names and shapes (`match_weights`), without reading a
tensor: a model on the meta device will do, so a run checks its `--init-weights` before it
builds anything and learns which parameters need no init of their own.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddp_amp.hf.safetensors_file import NotSafetensors, StoredTensor, read_header, read_slice
from ddp_amp.errors import UsageError
from ddp_amp.torch_api import DTensor, compute_local_shape_and_global_offset

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
FLAG = "--init-weights"
CONVERT_HINT = ("--init-weights reads safetensors only: save it again with "
                "model.save_pretrained(DIR, safe_serialization=True), or safetensors.torch.save_file(state_dict, F)")


@dataclass(frozen=True)
class WeightHeaders:
    """What the files of a source hold, read from their headers only: each name's file and shape."""

    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    stored: dict[str, StoredTensor]  # where each lies in its file


def read_headers(source: str | Path) -> WeightHeaders:
    """Every tensor name of `source`, its file and shape, from the headers of every file (no
    tensor is read); a one-line UsageError for a source that is none of the three layouts, an
    index that does not parse, a file missing, truncated or unreadable, or an index naming a
    tensor its file lacks."""
    path = Path(source)
    index: dict[str, Path] | None = None
    if path.is_dir():
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
                index = {name: path / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise UsageError(FLAG, str(path / INDEX), "a Hugging Face index with a weight_map",
                                 f"it does not parse as one ({error}); write it with save_pretrained") from None
        elif (path / SINGLE).is_file():
            path = path / SINGLE
        elif any((path / name).is_file() for name in PICKLED):
            raise UsageError(FLAG, str(source), f"a directory with {INDEX} or {SINGLE}",
                             f"it holds PyTorch pickles ({PICKLED[0]}); " + CONVERT_HINT)
        else:
            raise UsageError(FLAG, str(source), f"a .safetensors file, or a directory with {INDEX} or {SINGLE}",
                             "point it at the directory save_pretrained wrote, or at one .safetensors file")
    elif not path.is_file():
        raise UsageError(FLAG, str(source), "an existing .safetensors file or directory",
                         "check the path (a Hugging Face model directory, or a .safetensors file)")
    if index is None:
        stored = _header(path)
        return WeightHeaders({name: path for name in stored}, {name: t.shape for name, t in stored.items()}, stored)
    headers = {file: _header(file) for file in sorted(set(index.values()))}
    for name, file in index.items():
        if name not in headers[file]:
            raise UsageError(FLAG, f"{name} in {file}", f"every tensor {INDEX} maps to a file in that file",
                             "the file and the index come from different saves; copy the model directory again")
    return WeightHeaders(index, {name: headers[file][name].shape for name, file in index.items()},
                         {name: headers[file][name] for name, file in index.items()})


def _header(file: Path) -> dict[str, StoredTensor]:
    """Where each tensor of one .safetensors file lies, from its header, checked against the
    file's size (a truncated file is refused here)."""
    if not file.is_file():
        raise UsageError(FLAG, str(file), "an existing .safetensors file (the index names it)",
                         "copy or download the whole model directory, every file the index lists")
    try:
        return read_header(file)
    except NotSafetensors as error:
        pickled = str(error).startswith("it is a PyTorch pickle")
        raise UsageError(FLAG, str(file), "a complete, readable .safetensors file",
                         f"{error}; " + (CONVERT_HINT if pickled else "copy or download it again")) from None
    except OSError as error:
        raise UsageError(FLAG, str(file), "a readable .safetensors file",
                         f"{type(error).__name__}: {error.strerror}; check its permissions") from None


@dataclass(frozen=True)
class LoadedWeights:
    """What `load_pretrained` did on this rank."""

    tensors: int  # model tensors filled
    bytes_read: int  # bytes this rank read from the files
    missing: tuple[str, ...] = ()  # names left as initialised (strict=False only)
    unexpected: tuple[str, ...] = ()  # names of the files the model has not (strict=False only)


@dataclass(frozen=True)
class WeightsMatch:
    """How the files' names meet a model's tensors."""

    chosen: dict[str, str]  # file name -> the model's (first) name of the tensor it fills
    filled: frozenset[str]  # every name of every tensor filled (a tied weight's each name)
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def match_weights(model: nn.Module, headers: WeightHeaders, strict: bool = True) -> WeightsMatch:
    """Which file tensor fills which of `model`'s parameters and persistent buffers (a model
    on the meta device will do: only names and shapes are read); a one-line UsageError for a
    name missing or unexpected under `strict`, or for any shape that differs."""
    chosen: dict[str, str] = {}
    filled: set[str] = set()
    missing: list[str] = []
    groups = _tensor_groups(model)
    for names, tensor in groups:
        found = next((name for name in names if name in headers.files), None)
        if found is None:
            missing.append(names[0])
            continue
        shape = headers.shapes[found]
        if shape != tuple(tensor.shape):
            raise UsageError(FLAG, found, f"shape {tuple(tensor.shape)} as the model's {names[0]}",
                             f"{headers.files[found]} holds {shape}: another model size or config")
        chosen[found] = names[0]
        filled.update(names)
    known = {name for names, _ in groups for name in names}
    unexpected = sorted(name for name in headers.files if name not in known)
    if strict and missing:
        raise _mismatch("missing", missing, "a weight for every parameter and persistent buffer of the model",
                        "the files lack these names; pass --no-init-weights-strict to keep their init")
    if strict and unexpected:
        raise _mismatch("unexpected", unexpected, "only names the model has",
                        "the files hold weights the model lacks (another architecture or config?); "
                        "--no-init-weights-strict ignores them")
    return WeightsMatch(chosen, frozenset(filled), tuple(missing), tuple(unexpected))


def load_pretrained(model: nn.Module, source: str | Path, strict: bool = True) -> LoadedWeights:
    """Fill `model`'s parameters and persistent buffers from `source` by name (no collective:
    each rank reads its own slices); see the module's docstring. Every file, name and shape
    is checked before anything is copied: a refused load leaves the model as it was."""
    headers = read_headers(source)
    matched = match_weights(model, headers, strict)
    tensors = {name: tensor for names, tensor in _tensor_groups(model) for name in names[:1]}
    read = 0
    with ExitStack() as stack, torch.no_grad():
        opened = {}
        for path in sorted({headers.files[name] for name in matched.chosen}):
            opened[path] = os.open(path, os.O_RDONLY)
            stack.callback(os.close, opened[path])
        for file_name, model_name in matched.chosen.items():
            read += _fill(tensors[model_name], opened[headers.files[file_name]], headers.stored[file_name])
    return LoadedWeights(len(matched.chosen), read, matched.missing, matched.unexpected)


def _tensor_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each parameter and persistent buffer once, with every name it goes by (tied weights)."""
    by_identity: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            by_identity.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(by_identity.values())


def _fill(tensor: torch.Tensor, fd: int, stored: StoredTensor) -> int:
    """Copy this rank's part of `stored` (in the open file `fd`) into `tensor`; the bytes read."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                    tensor.placements)
        if local.numel() == 0:
            return 0
        part = read_slice(fd, stored, tuple(slice(start, start + size) for start, size in zip(offset, local_shape)))
        local.copy_(part)
        return part.numel() * part.element_size()
    whole = read_slice(fd, stored)
    tensor.copy_(whole)
    return whole.numel() * whole.element_size()


def _mismatch(kind: str, names: list[str], expected: str, hint: str) -> UsageError:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return UsageError(f"{FLAG} ({kind})", names[0] + more, expected, hint)
