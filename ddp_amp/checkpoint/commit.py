"""The commit protocol: a checkpoint appears whole or not at all, and old ones go only after.

1. Write every file into `.tmp-<name>-<pid>/` beside the target, fsyncing each.
2. Write `manifest.json` (sizes + sha256 of the others) last, fsync it and the directory.
3. Rename the directory to its name (atomic on POSIX), then fsync the parent so the rename
   itself survives a power cut.
4. Only then, for a run's `step-N` checkpoints, apply `--keep-last` (retention.py: renamed
   out of sight now, deleted in the background): a crash or a full disk at any point
   leaves every previously committed checkpoint untouched.
`commit_directory` does 1-3 for any target; `commit_checkpoint` adds 4 for a target that is
a `step-N` directory, whose siblings are the run's other checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ddp_amp.checkpoint.discovery import ASIDE_PREFIX, SCRATCH_PREFIX, step_of
from ddp_amp.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, FileRecord, encode_manifest
from ddp_amp.checkpoint.retention import Retention
from ddp_amp.durable import fsync_dir




class _HashingWriter:
    """A file wrapper that hashes and counts what passes through, and keeps a write's OSError.

    Hashing on the way out spares reading the file back for the manifest. torch.save turns
    a failed write into a RuntimeError without the errno ("unexpected pos ..."); keeping
    the original lets a full disk be reported as a full disk.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.handle.write(data)
        except OSError as error:
            self.error = error
            raise
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.handle.flush()


def _write_file(path: Path, payload: Any) -> FileRecord:
    """bytes are written as they are; anything else through torch.save. Then fsync."""
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle)
        if isinstance(payload, bytes):
            writer.write(payload)
        else:
            try:
                torch.save(payload, writer)  # type: ignore[arg-type]  # torch.save uses only write() and flush()
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
        handle.flush()
        os.fsync(handle.fileno())
    return {"size": writer.size, "sha256": writer.digest.hexdigest()}


def check_writable(root: Path) -> None:
    """Create `root` and write+remove a probe file; raises OSError if that fails."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f"{SCRATCH_PREFIX}probe-{os.getpid()}"
    _write_file(probe, b"ok")
    probe.unlink()


def _move_into_place(scratch: Path, target: Path) -> None:
    """Rename `scratch` to `target`; an existing `target` (same step saved again) is replaced."""
    if not target.exists():
        os.rename(scratch, target)
        return
    # rename() cannot replace a non-empty directory; move the old one aside first. Only
    # the same step is briefly absent here, never an older checkpoint.
    aside = target.with_name(f"{ASIDE_PREFIX}{target.name}-{os.getpid()}")
    os.rename(target, aside)
    os.rename(scratch, target)
    shutil.rmtree(aside, ignore_errors=True)


def scratch_for(target: Path) -> Path:
    """Where this process writes `target` before the rename that commits it."""
    return target.with_name(f"{SCRATCH_PREFIX}{target.name}-{os.getpid()}")


def new_scratch(target: Path) -> Path:
    """An empty scratch directory for `target` (what a killed write of it left is cleared)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_for(target)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    return scratch


def commit_directory(target: Path, files: dict[str, Any], step: int = 0,
                     written: tuple[Path, dict[str, FileRecord]] | None = None) -> Path:
    """Write `files` (name -> bytes or torch.save-able object) as the directory `target`.

    `written`: a scratch directory (`new_scratch`) that holds files written already, by
    other processes too (a sharded checkpoint's shards), with their records; the manifest
    covers them and `files`. Returns `target`. On any failure the partial directory is
    removed (which also frees the space a full disk needs) and the error propagates;
    nothing else changes. An existing `target` is replaced whole (see `_move_into_place`).
    """
    scratch, records = written if written is not None else (None, {})
    records = dict(records)
    try:
        scratch = scratch if scratch is not None else new_scratch(target)
        folders = {scratch}
        for name, payload in files.items():
            (scratch / name).parent.mkdir(exist_ok=True)  # a file of a folder: each rank's RNG
            folders.add((scratch / name).parent)
            records[name] = _write_file(scratch / name, payload)
        manifest = {"format": FORMAT_VERSION, "step": step, "files": records}
        _write_file(scratch / MANIFEST_NAME, encode_manifest(manifest))
        for folder in sorted(folders, reverse=True):  # a folder's entries before the folder's own
            fsync_dir(folder)
        _move_into_place(scratch, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(scratch if scratch is not None else scratch_for(target), ignore_errors=True)
        raise
    # What killed writes of this name left behind is obsolete now that a whole one is here.
    for pattern in (f"{SCRATCH_PREFIX}{target.name}-*", f"{ASIDE_PREFIX}{target.name}-*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    return target


def commit_checkpoint(target: Path, files: dict[str, Any], keep_last: int = 0,
                      written: tuple[Path, dict[str, FileRecord]] | None = None,
                      retention: Retention | None = None) -> Path:
    """Commit `files` (and what is `written` already) as the directory `target`; where it is
    a `step-N` directory, then apply retention to its siblings (`keep_last`, 0 keeps all):
    through `retention`, deleted in the background, else here."""
    step = step_of(target)
    if retention is not None:
        retention.wait()  # the previous deletion is done before this commit touches the folder
    target = commit_directory(target, files, step or 0, written)
    if step is not None:
        remove_scratch(target.parent)
        (retention or Retention()).apply(target.parent, keep_last, target, background=retention is not None)
    return target


def remove_scratch(root: Path) -> None:
    """Delete leftovers of writes that died (killed writers leave `.tmp-*` directories)."""
    for entry in root.glob(f"{SCRATCH_PREFIX}*"):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
