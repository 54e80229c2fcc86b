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
ranks (`load_sharded`), and runs no pickled code (sharded_reader.py).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ddp_amp.checkpoint.commit import new_scratch
from ddp_amp.checkpoint.manifest import SHARDED_DIR, FileRecord, record_of
from ddp_amp.checkpoint.meta import Meta
from ddp_amp.checkpoint.retention import Retention
from ddp_amp.checkpoint.rng import gather_rng_states
from ddp_amp.checkpoint.save import SaveResult, build_contents, commit_outcome, commit_to, write_failure
from ddp_amp.checkpoint.sharded_reader import SafeShardReader
from ddp_amp.distributed import all_gather_objects, on_rank_zero
from ddp_amp.durable import fsync_dir
from ddp_amp.errors import CheckpointError, UsageError
from ddp_amp.torch_api import SHARDING, AsyncSaveResponse


def _own_records(folder: Path, rank: int) -> dict[str, FileRecord]:
    """The files this rank wrote into the sharded folder, fsynced, by their checkpoint-relative name."""
    mine = sorted(folder.glob(f"__{rank}_*")) + ([folder / ".metadata"] if rank == 0 else [])
    return {f"{SHARDED_DIR}/{path.name}": record_of(path) for path in mine}


Report = tuple[dict[str, FileRecord] | None, str]  # a rank's files and their records, or why it has none


def _write_own(scratch: Path, rank: int, write: Callable[[], Any]) -> Report:
    """`write()` this rank's shards into the scratch directory, then its report."""
    try:
        write()
        return _own_records(scratch / SHARDED_DIR, rank), ""
    except (OSError, dcp.CheckpointException) as error:
        return None, f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"


def _commit(target: Path, scratch: Path, reports: list[Report], contents: dict[str, Any],
            keep_last: int, retention: Retention | None) -> tuple[str | None, CheckpointError | None]:
    """Rank 0: commit the scratch directory once every rank reported its shards whole."""
    failed = [why for _, why in reports if why]
    if failed:
        shutil.rmtree(scratch, ignore_errors=True)
        return None, write_failure(target, OSError(failed[0]))
    fsync_dir(scratch / SHARDED_DIR)
    written = {name: record for records, _ in reports for name, record in (records or {}).items()}
    return commit_outcome(target, commit_to(target, keep_last, (scratch, written), retention), contents)


def save_sharded(target: Path, files: dict[str, Any], meta: Meta, sharded: dict[str, Any],
                 device: torch.device, world_size: int, keep_last: int = 0,
                 retention: Retention | None = None) -> SaveResult:
    """Commit a checkpoint at `target` whose `sharded` state every rank writes its part of
    (collective; `files` and `meta` as for `save_directory`, written by rank 0)."""
    rng_states = gather_rng_states(device)
    scratch = Path(on_rank_zero(lambda: str(new_scratch(target))))
    rank = dist.get_rank()
    reports = all_gather_objects(_write_own(scratch, rank, lambda: dcp.save(
        sharded, checkpoint_id=str(scratch / SHARDED_DIR))))
    path, failure = on_rank_zero(lambda: _commit(target, scratch, reports,
                                                 build_contents(files, meta, rng_states, world_size), keep_last,
                                                 retention))
    return SaveResult(Path(path) if path else None, failure)


def start_sharded_write(target: Path, sharded: dict[str, Any], group: Any, keep_last: int,
                        retention: Retention | None = None
                        ) -> Callable[[dict[str, Any]], tuple[str | None, CheckpointError | None] | None]:
    """Start writing `sharded` into a new scratch directory for `target` in the background
    (collective): DCP's async save on `group`, a process group of the saves' own, since the
    training's collectives go on in the meantime. Returns the writer thread's work, given
    rank 0's other files: wait for this rank's shards, report them over `group`, and on rank 0
    commit (its outcome; None elsewhere)."""
    scratch = Path(on_rank_zero(lambda: str(new_scratch(target))))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    saving = dcp.async_save(sharded, checkpoint_id=str(scratch / SHARDED_DIR), process_group=group)
    # A plain Future without an async stager (none is given); with one, the upload's own.
    future = saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving

    def work(contents: dict[str, Any]) -> tuple[str | None, CheckpointError | None] | None:
        report = _write_own(scratch, rank, future.result)
        reports: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(report, reports, dst=0, group=group)
        return _commit(target, scratch, reports, contents, keep_last, retention) if reports is not None else None

    return work


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
