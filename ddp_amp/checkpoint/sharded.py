"""Sharded checkpoints: every rank writes its own shards, rank 0 commits once all are whole.

A model sharded over the ranks (FSDP2) has no rank that holds all of it. Its state (and the
optimizer state built on it) is written with `torch.distributed.checkpoint` (DCP): each rank
its own `sharded/__<rank>_<n>.distcp`, rank 0 the `.metadata` that maps them. The commit
protocol is the same as for any checkpoint, stretched over the ranks:
1. rank 0 makes a fresh scratch directory and every rank learns its path;
2. every rank writes its shards into it (DCP's save, collective), fsyncs them and reports
   their sizes and sha256, or why it could not;
3. only if every rank reported its files whole does rank 0 write the other files, the
   manifest over all of them, and rename the directory into place (then retention).
A rank killed mid-save leaves a scratch directory no reader takes for a checkpoint, and
every committed checkpoint untouched; DCP's own `.metadata` never marks a directory
complete here: the manifest does. Loading reshards, so a run resumes on another number of
ranks (`load_sharded`).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ddp_amp.checkpoint.commit import new_scratch
from ddp_amp.checkpoint.manifest import FileRecord, record_of
from ddp_amp.checkpoint.rng import gather_rng_states
from ddp_amp.checkpoint.save import SaveResult, build_contents, commit_outcome, commit_to, write_failure
from ddp_amp.distributed import all_gather_objects, on_rank_zero
from ddp_amp.durable import fsync_dir
from ddp_amp.errors import CheckpointError

SHARDED_DIR = "sharded"


def _own_records(folder: Path, rank: int) -> dict[str, FileRecord]:
    """The files this rank wrote into the sharded folder, fsynced, by their checkpoint-relative name."""
    mine = sorted(folder.glob(f"__{rank}_*")) + ([folder / ".metadata"] if rank == 0 else [])
    return {f"{SHARDED_DIR}/{path.name}": record_of(path) for path in mine}


def save_sharded(target: Path, files: dict[str, Any], meta: dict[str, Any], sharded: dict[str, Any],
                 device: torch.device, world_size: int, keep_last: int = 0) -> SaveResult:
    """Commit a checkpoint at `target` whose `sharded` state every rank writes its part of
    (collective; `files` and `meta` as for `save_directory`, written by rank 0)."""
    rng_states = gather_rng_states(device)
    scratch = Path(on_rank_zero(lambda: str(new_scratch(target))))
    rank = dist.get_rank()
    try:
        dcp.save(sharded, checkpoint_id=str(scratch / SHARDED_DIR))
        report: tuple[dict[str, FileRecord] | None, str] = (_own_records(scratch / SHARDED_DIR, rank), "")
    except (OSError, dcp.CheckpointException) as error:
        report = (None, f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    reports = all_gather_objects(report)

    def commit() -> tuple[str | None, CheckpointError | None]:
        failed = [why for _, why in reports if why]
        if failed:
            shutil.rmtree(scratch, ignore_errors=True)
            return None, write_failure(target, OSError(failed[0]))
        fsync_dir(scratch / SHARDED_DIR)
        written = {name: record for records, _ in reports for name, record in (records or {}).items()}
        contents = build_contents(files, meta, rng_states, world_size)
        return commit_outcome(target, commit_to(target, keep_last, (scratch, written)), contents)

    path, failure = on_rank_zero(commit)
    return SaveResult(Path(path) if path else None, failure)


def load_sharded(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill `template` (state dicts of the live objects, sharded or not) from the sharded
    part of checkpoint `path`, resharding to this world size; returns it (collective where a
    process group exists, else read by this process alone)."""
    with warnings.catch_warnings():  # a single process without a group is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=str(path / SHARDED_DIR), no_dist=not dist.is_initialized())
    return template


def sharded_shapes(path: Path, key: str) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor of entry `key` in checkpoint `path`'s sharded state
    (from DCP's metadata: nothing is read but the map)."""
    metadata = dcp.FileSystemReader(str(path / SHARDED_DIR)).read_metadata()
    prefix = f"{key}."
    return {name[len(prefix):]: tuple(item.size) for name, item in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(item, dcp.TensorStorageMetadata)}


def sharded_tensors(path: Path, key: str) -> dict[str, torch.Tensor]:
    """Entry `key` of checkpoint `path`'s sharded state, whole, on the CPU, in this process
    alone (no process group needed): what an export writes."""
    metadata = dcp.FileSystemReader(str(path / SHARDED_DIR)).read_metadata()
    prefix = f"{key}."
    template = {name[len(prefix):]: torch.empty(item.size, dtype=item.properties.dtype)
                for name, item in metadata.state_dict_metadata.items()
                if name.startswith(prefix) and isinstance(item, dcp.TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: template}, checkpoint_id=str(path / SHARDED_DIR), no_dist=True)
    return template
