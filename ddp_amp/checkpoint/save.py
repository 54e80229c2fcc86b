"""Saving as a collective: each rank writes what it owns, rank 0 commits, every rank learns the outcome.

1. Rank 0 checks that every file it writes will load back (`build_contents`) and that the
   target is ours to replace, and makes the scratch directory; every rank learns its path,
   or the refusal, before anything is written (`distributed.on_rank_zero`).
2. Every rank writes its own files into it (rank_files.py): its DCP shards where the state
   is sharded, its RNG file, its values of the per-rank entries (rank_values.py) and its
   record, each hashed as it is written.
3. One exchange of fixed-size reports (rank_reports.py: all-reduces, no fan-in to rank 0)
   tells rank 0 that every rank's files are whole, or why one is not; rank 0 writes its
   files and the manifest and renames the directory into place (commit.py), and every rank
   learns the committed path or why there is none, and which checkpoints retention
   retired, to delete its own files of them (retention.py).
Rank 0's work does not grow with the number of ranks: it lists no folder the ranks write
into, reads none of their files, and receives a fixed-size sum of their reports. No rank carries on believing a
checkpoint exists that does not, and no rank waits on a rank 0 that failed. `background.py`
runs steps 2 and 3 in a writer thread on every rank (`--async-checkpoint`).

The caller names the files (the Trainer: model, train state; `Session`: the user's state);
`meta.json` (world size, versions, the caller's description) is added here.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.checkpoint.commit import Written, check_writable, commit_checkpoint, new_scratch
from ddp_amp.checkpoint.discovery import list_step_dirs
from ddp_amp.checkpoint.manifest import MANIFEST_NAME, SHARDED_DIR, FileRecord, RanksRecord
from ddp_amp.checkpoint.meta import META_FILE, Meta
from ddp_amp.checkpoint.rank_files import OWN_FOLDERS, write_own_files
from ddp_amp.checkpoint.rank_reports import Reports, exchange_reports
from ddp_amp.checkpoint.rank_values import PER_RANK_DIR
from ddp_amp.checkpoint.retention import Retention
from ddp_amp.checkpoint.rng import capture_rng
from ddp_amp.checkpoint.safe_types import check_loadable
from ddp_amp.checkpoint.shard_writer import HashingShardWriter, write_shards
from ddp_amp.distributed import on_rank_zero
from ddp_amp.errors import CheckpointError, UsageError
from ddp_amp.version import __version__

_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
Outcome = tuple[str | None, CheckpointError | None]  # the committed path, or why there is none
# ... and the checkpoints retention retired in the commit, whose files each rank deletes its own of
Committed = tuple[str | None, CheckpointError | None, list[str]]


@dataclass(frozen=True)
class SaveResult:
    """The outcome every rank sees: the committed directory, or why there is none, and the
    checkpoints retention retired (each rank deletes its own files of them)."""

    path: Path | None
    error: CheckpointError | None
    retired: tuple[str, ...] = ()


def write_failure(target: Path, error: OSError) -> CheckpointError:
    siblings = list_step_dirs(target.parent)
    if target.exists():
        kept_note = f"the previous {target.name} is kept"
    elif siblings:
        kept_note = f"the previous checkpoint {siblings[-1][1].name} is kept"
    else:
        kept_note = "no earlier checkpoint exists"
    if error.errno in _NO_SPACE:
        hint = f"free disk space (or lower --keep-last); {kept_note}"
    else:
        hint = f"make the directory writable or pick another location; {kept_note}"
    return CheckpointError("checkpoint", str(target), f"a complete write, but it failed: "
                           f"{error.strerror or error}", hint)


def _entries(files: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) to check: each top-level entry of a dict file, so errors name the key."""
    found: list[tuple[str, Any]] = []
    for name, payload in files.items():
        if isinstance(payload, dict):
            found.extend((f"{name}[{key!r}]", value) for key, value in payload.items())
        elif not isinstance(payload, bytes):
            found.append((name, payload))
    return found


def build_contents(files: dict[str, Any], meta: Meta, world_size: int) -> dict[str, Any]:
    """Rank 0: every file it commits (the caller's `files` and `meta.json`), once each value
    is known to load back; a value a safe load would refuse raises UsageError, before
    anything is written."""
    for name, value in _entries(files):
        check_loadable(name, value)
    description = meta.merged({"world_size": world_size, "ddp_amp_version": __version__,
                               "torch_version": torch.__version__})
    return {**files, META_FILE: description.encode()}


def scratch_folders(sharded: bool, per_rank: bool = False) -> tuple[str, ...]:
    """The folders of a scratch directory the ranks write their own files into."""
    return OWN_FOLDERS + ((PER_RANK_DIR,) if per_rank else ()) + ((SHARDED_DIR,) if sharded else ())


def prepare(target: Path, files: dict[str, Any], meta: Meta, world_size: int, contents: dict[str, Any],
            folders: tuple[str, ...]) -> Outcome:
    """Rank 0, before any rank writes: refuse a `target` that is not ours to replace, or a
    value that would not load back (UsageError); else put rank 0's files into `contents`,
    make the scratch directory with its `folders`, and return its path, or (None, why)
    where the disk refused.

    A checkpoint already at `target` is replaced once the new one is whole; anything else
    there (a file, a directory without a manifest) is the user's and is never replaced.
    """
    if target.exists() and not (target / MANIFEST_NAME).is_file():
        raise UsageError("checkpoint path", str(target), "a writable checkpoint location: a new "
                         "path or an earlier checkpoint (a directory with manifest.json)",
                         "something else is there and is not overwritten; pick another path")
    contents.update(build_contents(files, meta, world_size))
    try:
        return str(new_scratch(target, folders)), None
    except OSError as error:
        return None, write_failure(target, error)


def commit_outcome(target: Path, commit: Callable[[dict[str, Any]], Path], contents: dict[str, Any]) -> Outcome:
    """Rank 0: commit `contents`; (the committed path, None) or (None, why the disk refused).

    The one write step of both a synchronous save and a background one, so both go through
    the same commit protocol, manifest and retention.
    """
    try:
        return str(commit(contents)), None
    except OSError as error:
        return None, write_failure(target, error)


def commit_reported(target: Path, scratch: Path, reports: Reports | None, contents: dict[str, Any],
                    shared: dict[str, FileRecord], folders: tuple[str, ...], keep_last: int,
                    retention: Retention | None, outcome: Callable[..., Outcome] = commit_outcome) -> Committed:
    """Rank 0: commit `scratch` as `target` once every rank reported its own files whole
    (`reports`, exchanged), with rank 0's `contents` and the `shared` files written there
    already (the shards' map); through `outcome` (`commit_outcome`). A rank's failure
    removes the scratch directory and is the outcome. `keep_last` and `retention` as for
    `commit_checkpoint`; the outcome names what `retention` retired."""
    if reports is None:
        raise RuntimeError("only rank 0 commits a checkpoint: it alone holds the exchanged reports")
    failed = reports.first_failure()
    if failed is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        return None, write_failure(target, OSError(failed)), []
    written = Written(scratch, shared, folders, RanksRecord(reports.count, reports.digest().hex()))
    path, error = outcome(target, partial(commit_checkpoint, target, keep_last=keep_last, written=written,
                                          retention=retention), contents)
    return path, error, retention.take_retired() if retention is not None else []


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(target: Path, files: dict[str, Any], meta: Meta, device: torch.device, world_size: int,
                    keep_last: int = 0, retention: Retention | None = None,
                    sharded: dict[str, Any] | None = None, values: dict[str, Any] | None = None) -> SaveResult:
    """Commit a checkpoint as the directory `target` (collective; see the module's docstring):
    rank 0's `files`, and, where given, the `sharded` state (DCP's form) every rank writes
    its part of and each rank's own per-rank `values`. Where `target` is a `step-N`
    directory, retention then keeps the newest `keep_last` of its siblings (0 keeps all),
    through `retention` where given (the caller's to pass `SaveResult.retired` on to every
    rank's `Retention.let_go_own`), else deleted here.

    A write that fails for the disk's sake (full, read-only), on any rank, comes back as
    `SaveResult.error` on every rank; state that would not load back, or a `target` that is
    not ours to replace, raises UsageError on every rank; either way nothing older is touched.
    """
    contents: dict[str, Any] = {}
    folders = scratch_folders(sharded is not None, bool(values))
    path, failure = on_rank_zero(lambda: prepare(target, files, meta, world_size, contents, folders))
    if path is None:
        return SaveResult(None, failure)
    scratch = Path(path)
    writer = HashingShardWriter(scratch / SHARDED_DIR) if sharded is not None else None
    shards = partial(write_shards, writer, sharded) if writer is not None and sharded is not None else None
    if retention is not None:
        retention.wait()  # this rank's files of what the last commit retired are gone before it reports
    reports = exchange_reports(write_own_files(scratch, this_rank(), capture_rng(device), shards, values), device)
    path, failure, retired = on_rank_zero(lambda: commit_reported(
        target, scratch, reports, contents, writer.map_record() if writer is not None else {}, folders, keep_last,
        retention))
    return SaveResult(Path(path) if path else None, failure, tuple(retired))


def ensure_writable(root: Path, run_dir: Path) -> None:
    """Fail early, on every rank, if rank 0 cannot write checkpoints under `root` (collective)."""
    def probe() -> None:
        try:
            check_writable(root)
        except OSError as error:
            raise UsageError("--run-dir", str(run_dir), "a writable directory for checkpoints",
                             f"{error.strerror or error} ({error.filename or root}); pick another "
                             "--run-dir or fix its permissions") from None

    on_rank_zero(probe)
