"""Saving as a collective: every rank calls it, rank 0 writes, every rank learns the outcome.

RNG states are gathered from all ranks first (each rank's dropout stream differs); then
rank 0 checks that every file will load back (`build_contents`), commits the directory
(`commit_outcome`) and tells every rank the committed path or why there is none
(`distributed.on_rank_zero`), so no rank carries on believing a checkpoint exists that does not,
and no rank waits on a rank 0 that failed. `background.py` runs the same two steps with
the commit in a writer thread (`--async-checkpoint`).

The caller names the files (the Trainer: model, train state; `Session`: the user's
state); `rng.pt` (every rank's RNG) and `meta.json` (world size, versions, the caller's
description) are added here.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_amp.checkpoint.commit import check_writable, commit_checkpoint, commit_directory
from ddp_amp.checkpoint.discovery import list_step_dirs, step_dir_name
from ddp_amp.checkpoint.manifest import MANIFEST_NAME
from ddp_amp.checkpoint.rng import gather_rng_states
from ddp_amp.checkpoint.safe_types import check_loadable
from ddp_amp.distributed import on_rank_zero
from ddp_amp.errors import CheckpointError, UsageError
from ddp_amp.version import __version__

META_FILE, RNG_FILE = "meta.json", "rng.pt"
_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


@dataclass(frozen=True)
class SaveResult:
    """The outcome every rank sees: the committed directory, or why there is none."""

    path: Path | None
    error: CheckpointError | None


def _write_failure(target: Path, error: OSError) -> CheckpointError:
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
    found = []
    for name, payload in files.items():
        if isinstance(payload, dict):
            found.extend((f"{name}[{key!r}]", value) for key, value in payload.items())
        elif not isinstance(payload, bytes):
            found.append((name, payload))
    return found


def build_contents(files: dict[str, Any], meta: dict[str, Any], rng_states: list[dict[str, Any]] | None,
                   world_size: int) -> dict[str, Any]:
    """Rank 0: every file the commit writes, once each value is known to load back.

    `files` are the caller's; `rng.pt` (the gathered RNG states) and `meta.json` are added.
    A value a safe load would refuse raises UsageError, before anything is written.
    """
    for name, value in _entries(files):
        check_loadable(name, value)
    description = {**meta, "world_size": world_size, "ddp_amp_version": __version__,
                   "torch_version": torch.__version__}
    return {**files, RNG_FILE: {"ranks": rng_states},
            META_FILE: (json.dumps(description, indent=2, sort_keys=True, default=str) + "\n").encode()}


def commit_outcome(target: Path, commit: Callable[[dict[str, Any]], Path],
                   contents: dict[str, Any]) -> tuple[str | None, CheckpointError | None]:
    """Rank 0: commit `contents`; (the committed path, None) or (None, why the disk refused).

    The one write step of both a synchronous save and a background one, so both go through
    the same commit protocol, manifest and retention.
    """
    try:
        return str(commit(contents)), None
    except OSError as error:
        return None, _write_failure(target, error)


def _save(target: Path, commit: Callable[[dict[str, Any]], Path], files: dict[str, Any],
          meta: dict[str, Any], device: torch.device, world_size: int) -> SaveResult:
    rng_states = gather_rng_states(device)
    path, failure = on_rank_zero(
        lambda: commit_outcome(target, commit, build_contents(files, meta, rng_states, world_size)))
    return SaveResult(Path(path) if path else None, failure)


def save_checkpoint(root: Path, step: int, files: dict[str, Any], meta: dict[str, Any],
                    device: torch.device, world_size: int, keep_last: int = 0) -> SaveResult:
    """Commit checkpoint `step` under `root` and apply retention (collective).

    A write that fails for the disk's sake (full, read-only) comes back as
    `SaveResult.error` on every rank; state that would not load back raises UsageError
    on every rank; either way nothing older is touched.
    """
    return _save(root / step_dir_name(step), commit_step(root, step, keep_last), files, meta, device, world_size)


def commit_step(root: Path, step: int, keep_last: int) -> Callable[[dict[str, Any]], Path]:
    """The commit of a run's checkpoint `step`: its `step-N` directory, then retention."""
    return lambda contents: commit_checkpoint(root, step, contents, keep_last)


def save_directory(target: Path, files: dict[str, Any], meta: dict[str, Any], device: torch.device,
                   world_size: int) -> SaveResult:
    """Commit a checkpoint as the directory `target`, replacing a checkpoint there (collective).

    Anything else at `target` (a file, a directory without a manifest) is the user's and
    is never replaced: the save raises UsageError on every rank instead.
    """
    def commit(contents: dict[str, Any]) -> Path:
        if target.exists() and not (target / MANIFEST_NAME).is_file():
            raise UsageError("checkpoint path", str(target), "a writable checkpoint location: a new "
                             "path or an earlier checkpoint (a directory with manifest.json)",
                             "something else is there and is not overwritten; pick another path")
        return commit_directory(target, contents)

    return _save(target, commit, files, meta, device, world_size)


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
