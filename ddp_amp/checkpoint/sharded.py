"""Sharded checkpoints: every rank writes its own shards, and a load reshards them onto any world.

A model sharded over the ranks (FSDP2) has no rank that holds all of it. Its state (and the
optimizer state built on it) is written with `torch.distributed.checkpoint` (DCP): each rank
its own `sharded/__<rank>_<n>.distcp`, rank 0 the `.metadata` that maps them, into the
scratch directory of the one commit protocol (save.py): each rank hashes its shards as DCP
writes them (shard_writer.py) and lists them in its own record, and rank 0 commits only once
every rank reported its files whole. A rank killed mid-save leaves a scratch directory no
reader takes for a checkpoint, and every committed checkpoint untouched; DCP's own
`.metadata` never marks a directory complete here: the manifest does. Loading reshards, so a
run resumes on another number of ranks (`load_sharded`), and runs no pickled code
(sharded_reader.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ddp_amp.checkpoint.manifest import SHARDED_DIR
from ddp_amp.checkpoint.sharded_reader import SafeShardReader
from ddp_amp.errors import UsageError
from ddp_amp.torch_api import SHARDING


def load_sharded(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill `template` (state dicts of the live objects, sharded or not) from the sharded
    part of checkpoint `path`, resharding to this world size; returns it (collective where a
    process group exists, else read by this process alone)."""
    _require_sharding(path)
    with warnings.catch_warnings(), _shards_refused(path):  # a single process without a group is what is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=SafeShardReader(path / SHARDED_DIR), no_dist=not dist.is_initialized())
    return template


def _require_sharding(path: Path) -> None:
    """Refuse reading checkpoint `path`'s DCP shards in one line where this torch cannot shard."""
    SHARDING.require("checkpoint", str(path), otherwise="resume from a checkpoint of a run without --shard")


@contextmanager
def _shards_refused(path: Path) -> Iterator[None]:
    """DCP's read failures (a shard file missing or damaged although the manifest matches it)
    as one line: DCP raises them on every rank alike, as a CheckpointException (a
    BaseException) whose text is a traceback per rank."""
    try:
        yield
    except (dcp.CheckpointException, OSError, EOFError) as error:
        failures = getattr(error, "failures", None) or {}
        first = next(iter(failures.values()), error)
        cause = first[0] if isinstance(first, tuple) else first  # DCP keeps (exception, traceback)
        reason = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
        raise UsageError("checkpoint", str(path / SHARDED_DIR), "shard files that hold what their map says",
                         f"reading them failed ({reason[:200]}); resume from an older checkpoint") from None


def sharded_shapes(path: Path, key: str) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor of entry `key` in checkpoint `path`'s sharded state
    (from DCP's metadata: nothing is read but the map)."""
    _require_sharding(path)
    metadata = SafeShardReader(path / SHARDED_DIR).read_metadata()
    prefix = f"{key}."
    return {name[len(prefix):]: tuple(item.size) for name, item in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(item, dcp.TensorStorageMetadata)}


def sharded_tensors(path: Path, key: str) -> dict[str, torch.Tensor]:
    """Entry `key` of checkpoint `path`'s sharded state, whole, on the CPU, in this process
    alone (no process group needed): what an export writes."""
    _require_sharding(path)
    metadata = SafeShardReader(path / SHARDED_DIR).read_metadata()
    prefix = f"{key}."
    template = {name[len(prefix):]: torch.empty(item.size, dtype=item.properties.dtype)
                for name, item in metadata.state_dict_metadata.items()
                if name.startswith(prefix) and isinstance(item, dcp.TensorStorageMetadata)}
    with warnings.catch_warnings(), _shards_refused(path):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: template}, storage_reader=SafeShardReader(path / SHARDED_DIR), no_dist=True)
    return template
