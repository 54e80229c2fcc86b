"""The commit protocol: a checkpoint appears whole or not at all, and old ones go only after.

1. Write every file into `.tmp-<name>-<pid>/` beside the target, fsyncing each (each rank
   writes its own files there first, see save.py; rank 0 writes the rest).
2. Write `manifest.json` (sizes + sha256 of rank 0's files, and the digest over the ranks'
   own records, see manifest.py) last, fsync it and the directories.
3. Rename the directory to its name (atomic on POSIX), then fsync the parent so the rename
   itself survives a power cut.
4. Only then, for a run's `step-N` checkpoints, apply `--keep-last` (retention.py: renamed
   out of sight now, then each rank deletes its own files of them in the background and
   rank 0 the rest): a crash or a full disk at any point leaves every previously committed
   checkpoint untouched.
`commit_directory` does 1-3 for any target; `commit_checkpoint` adds 4 for a target that is
a `step-N` directory, whose siblings are the run's other checkpoints. Nothing here reads or
lists what the ranks wrote: its file operations are the same at any world size, and what it
lets go (an older copy of the same step, leftovers of killed writes) is deleted with
retention's, in the background where retention runs there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_amp.checkpoint.discovery import ASIDE_PREFIX, SCRATCH_PREFIX, step_of
from ddp_amp.checkpoint.hashed_write import write_hashed
from ddp_amp.checkpoint.manifest import (FORMAT_VERSION, MANIFEST_NAME, RANKS_KEY, FileRecord, RanksRecord,
                                         encode_manifest)
from ddp_amp.checkpoint.retention import Retention
from ddp_amp.durable import fsync_dir


@dataclass(frozen=True)
class Written:
    """What is in a scratch directory (`new_scratch`) before rank 0 commits it: files written
    already, by other processes too, with their records (the shards' map), the folders the
    ranks wrote into, and the record of the ranks' own files for the manifest."""

    scratch: Path
    records: dict[str, FileRecord] = field(default_factory=dict)
    folders: tuple[str, ...] = ()
    ranks: RanksRecord | None = None


def check_writable(root: Path) -> None:
    """Create `root` and write+remove a probe file; raises OSError if that fails."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f"{SCRATCH_PREFIX}probe-{os.getpid()}"
    write_hashed(probe, b"ok")
    probe.unlink()


def _move_into_place(scratch: Path, target: Path) -> None:
    """Rename `scratch` to `target`; an existing `target` (same step saved again) is replaced,
    and left aside under a `.tmp-old-` name for the caller to delete."""
    if not target.exists():
        os.rename(scratch, target)
        return
    # rename() cannot replace a non-empty directory; move the old one aside first. Only
    # the same step is briefly absent here, never an older checkpoint.
    aside = target.with_name(f"{ASIDE_PREFIX}{target.name}-{os.getpid()}")
    os.rename(target, aside)
    os.rename(scratch, target)


def scratch_for(target: Path) -> Path:
    """Where this process writes `target` before the rename that commits it."""
    return target.with_name(f"{SCRATCH_PREFIX}{target.name}-{os.getpid()}")


def new_scratch(target: Path, folders: Sequence[str] = ()) -> Path:
    """An empty scratch directory for `target`, with the sub`folders` the ranks write into
    (what a killed write of it left is cleared)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_for(target)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    for folder in folders:
        (scratch / folder).mkdir()
    return scratch


def commit_directory(target: Path, files: dict[str, Any], step: int = 0, written: Written | None = None,
                     leftovers: list[Path] | None = None) -> Path:
    """Write `files` (name -> bytes or torch.save-able object) as the directory `target`.

    `written`: a scratch directory (`new_scratch`) that holds files written already (each
    rank's own, a sharded checkpoint's shards); the manifest covers them and `files`.
    Returns `target`. On any failure the partial directory is removed (which also frees the
    space a full disk needs) and the error propagates; nothing else changes. An existing
    `target` is replaced whole (see `_move_into_place`). What this lets go (the replaced
    copy, leftovers of killed writes of this name) is deleted here, or, given `leftovers`,
    added to it for the caller to delete.
    """
    written = written if written is not None else Written(new_scratch(target))
    scratch = written.scratch
    try:
        folders = {scratch, *(scratch / folder for folder in written.folders)}
        records = dict(written.records)
        for name, payload in files.items():
            (scratch / name).parent.mkdir(exist_ok=True)  # a file of a folder
            folders.add((scratch / name).parent)
            records[name] = write_hashed(scratch / name, payload)
        manifest: dict[str, Any] = {"format": FORMAT_VERSION, "step": step, "files": records}
        if written.ranks is not None:
            manifest[RANKS_KEY] = written.ranks.to_json()
        write_hashed(scratch / MANIFEST_NAME, encode_manifest(manifest))
        for folder in sorted(folders, reverse=True):  # a folder's entries before the folder's own
            fsync_dir(folder)
        _move_into_place(scratch, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    # What killed writes of this name left behind is obsolete now that a whole one is here.
    obsolete = [leftover for pattern in (f"{SCRATCH_PREFIX}{target.name}-*", f"{ASIDE_PREFIX}{target.name}-*")
                for leftover in target.parent.glob(pattern)]
    if leftovers is not None:
        leftovers.extend(obsolete)
    else:
        for leftover in obsolete:
            shutil.rmtree(leftover, ignore_errors=True)
    return target


def commit_checkpoint(target: Path, files: dict[str, Any], keep_last: int = 0, written: Written | None = None,
                      retention: Retention | None = None) -> Path:
    """Commit `files` (and what is `written` already) as the directory `target`; where it is
    a `step-N` directory, then apply retention to its siblings (`keep_last`, 0 keeps all).
    Through `retention`, what is let go is retired for every rank to delete its own files
    of (`Retention.take_retired`), else deleted here; so are the replaced copy of `target`
    and the leftovers of killed writes."""
    step = step_of(target)
    if retention is not None:
        retention.wait()  # the previous deletion is done before this commit touches the folder
    let_go: list[Path] = []
    target = commit_directory(target, files, step or 0, written, let_go)
    if step is not None:
        let_go += scratch_leftovers(target.parent)
    (retention or Retention()).apply(target.parent, keep_last if step is not None else 0, target,
                                     background=retention is not None, also=let_go)
    return target


def scratch_leftovers(root: Path) -> list[Path]:
    """Directories of writes that died (killed writers leave `.tmp-*` directories) under
    `root`; a stray `.tmp-` file is removed here."""
    found = []
    for entry in root.glob(f"{SCRATCH_PREFIX}*"):
        if entry.is_dir():
            found.append(entry)
        else:
            entry.unlink(missing_ok=True)
    return found
