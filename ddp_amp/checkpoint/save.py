"""Saving as a collective: every rank calls it, rank 0 writes, every rank learns the outcome.

RNG states are gathered from all ranks first (each rank's dropout stream differs); then
rank 0 checks that every file will load back (`build_contents`), commits the directory
(`commit_outcome`) and tells every rank the committed path or why there is none
(`distributed.on_rank_zero`), so no rank carries on believing a checkpoint exists that does not,
and no rank waits on a rank 0 that failed. `background.py` runs the same two steps with
the commit in a writer thread (`--async-checkpoint`).

The caller names the files (the Trainer: model, train state; `Session`: the user's
state); `rng/rank-NNNNN.pt` (each rank's RNG, a file each) and `meta.json` (world size, versions, the caller's
description) are added here.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_amp.checkpoint.commit import check_writable, commit_checkpoint
from ddp_amp.checkpoint.discovery import list_step_dirs
from ddp_amp.checkpoint.manifest import MANIFEST_NAME, FileRecord
from ddp_amp.checkpoint.meta import META_FILE, Meta
from ddp_amp.checkpoint.retention import Retention
from ddp_amp.checkpoint.rng import gather_rng_states, rng_files
from ddp_amp.checkpoint.safe_types import check_loadable
from ddp_amp.distributed import on_rank_zero
from ddp_amp.errors import CheckpointError, UsageError
from ddp_amp.version import __version__

_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


@dataclass(frozen=True)
class SaveResult:
    """The outcome every rank sees: the committed directory, or why there is none."""

    path: Path | None
    error: CheckpointError | None


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


def build_contents(files: dict[str, Any], meta: Meta, rng_states: list[dict[str, Any]] | None,
                   world_size: int) -> dict[str, Any]:
    """Rank 0: every file the commit writes, once each value is known to load back.

    `files` are the caller's; each rank's RNG file (from the gathered states) and
    `meta.json` are added.
    A value a safe load would refuse raises UsageError, before anything is written.
    """
    for name, value in _entries(files):
        check_loadable(name, value)
    description = meta.merged({"world_size": world_size, "ddp_amp_version": __version__,
                               "torch_version": torch.__version__})
    return {**files, **rng_files(rng_states or []), META_FILE: description.encode()}


def commit_outcome(target: Path, commit: Callable[[dict[str, Any]], Path],
                   contents: dict[str, Any]) -> tuple[str | None, CheckpointError | None]:
    """Rank 0: commit `contents`; (the committed path, None) or (None, why the disk refused).

    The one write step of both a synchronous save and a background one, so both go through
    the same commit protocol, manifest and retention.
    """
    try:
        return str(commit(contents)), None
    except OSError as error:
        return None, write_failure(target, error)


def commit_to(target: Path, keep_last: int = 0, written: tuple[Path, dict[str, FileRecord]] | None = None,
              retention: Retention | None = None) -> Callable[[dict[str, Any]], Path]:
    """Rank 0's commit of a checkpoint's contents (and of what is `written` already, as
    `commit_directory` takes it) as the directory `target`.

    A checkpoint already at `target` is replaced once the new one is whole; anything else
    there (a file, a directory without a manifest) is the user's and is never replaced: the
    commit raises UsageError instead. Where `target` is a `step-N` directory, retention then
    keeps the newest `keep_last` of its siblings (0 keeps all), through `retention` where
    given (deleted in the background).
    """
    def commit(contents: dict[str, Any]) -> Path:
        if target.exists() and not (target / MANIFEST_NAME).is_file():
            raise UsageError("checkpoint path", str(target), "a writable checkpoint location: a new "
                             "path or an earlier checkpoint (a directory with manifest.json)",
                             "something else is there and is not overwritten; pick another path")
        return commit_checkpoint(target, contents, keep_last, written, retention)

    return commit


def save_directory(target: Path, files: dict[str, Any], meta: Meta, device: torch.device,
                   world_size: int, keep_last: int = 0, retention: Retention | None = None) -> SaveResult:
    """Commit a checkpoint as the directory `target` (collective; see `commit_to`).

    A write that fails for the disk's sake (full, read-only) comes back as
    `SaveResult.error` on every rank; state that would not load back, or a `target` that
    is not ours to replace, raises UsageError on every rank; either way nothing older is
    touched.
    """
    rng_states = gather_rng_states(device)
    commit = commit_to(target, keep_last, retention=retention)
    path, failure = on_rank_zero(
        lambda: commit_outcome(target, commit, build_contents(files, meta, rng_states, world_size)))
    return SaveResult(Path(path) if path else None, failure)


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
