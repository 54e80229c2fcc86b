"""Saving as a collective: every rank calls it, rank 0 writes, every rank learns the outcome.

RNG states are gathered from all ranks first (each rank's dropout stream differs); then
rank 0 commits the checkpoint and broadcasts the committed path or the reason it failed,
so no rank carries on believing a checkpoint exists that does not.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.checkpoint.commit import check_writable, commit_checkpoint
from ddp_amp.checkpoint.discovery import list_step_dirs, step_dir_name
from ddp_amp.checkpoint.state import (META_FILE, MODEL_FILE, RNG_FILE, TRAIN_FILE, TrainingParts,
                                      capture_train_state, gather_rng_states)
from ddp_amp.dist import broadcast_object
from ddp_amp.errors import UsageError

_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class CheckpointError(UsageError):
    """A checkpoint could not be written; every older checkpoint is still in place."""


@dataclass(frozen=True)
class SaveResult:
    """The outcome every rank sees: the committed directory, or why there is none."""

    path: Path | None
    error: CheckpointError | None


def _write_failure(root: Path, step: int, error: OSError) -> tuple[str, str, str, str]:
    """CheckpointError's arguments (exceptions with custom __init__ do not survive pickling)."""
    kept = list_step_dirs(root)
    kept_note = (f"the previous checkpoint {kept[-1][1].name} is kept" if kept
                 else "no earlier checkpoint exists")
    if error.errno in _NO_SPACE:
        hint = f"free disk space (or lower --keep-last); {kept_note}"
    else:
        hint = f"make the run directory writable or pick another --run-dir; {kept_note}"
    return ("checkpoint", str(root / step_dir_name(step)),
            f"a complete write, but it failed: {error.strerror or error}", hint)


def save_checkpoint(root: Path, rank: int, parts: TrainingParts, step: int, samples_seen: int,
                    meta: dict[str, Any], keep_last: int) -> SaveResult:
    """Commit checkpoint `step` under `root` (collective: gather RNG, rank 0 writes, broadcast)."""
    rng_states = gather_rng_states(parts.device)
    outcome: tuple[str | None, tuple[str, str, str, str] | None] = (None, None)
    if rank == 0:
        files = {
            MODEL_FILE: parts.model.state_dict(),
            TRAIN_FILE: capture_train_state(parts, step, samples_seen),
            RNG_FILE: {"ranks": rng_states},
            META_FILE: (json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n").encode(),
        }
        try:
            outcome = (str(commit_checkpoint(root, step, files, keep_last)), None)
        except OSError as error:
            outcome = (None, _write_failure(root, step, error))
    path, failure = broadcast_object(outcome)  # type: ignore[misc]
    return SaveResult(Path(path) if path else None, CheckpointError(*failure) if failure else None)


def ensure_writable(root: Path, run_dir: Path, rank: int) -> None:
    """Fail early, on every rank, if rank 0 cannot write checkpoints under `root` (collective)."""
    problem: str | None = None
    if rank == 0:
        try:
            check_writable(root)
        except OSError as error:
            problem = f"{error.strerror or error} ({error.filename or root})"
    problem = broadcast_object(problem)  # type: ignore[assignment]
    if problem:
        raise UsageError("--run-dir", str(run_dir), "a writable directory for checkpoints",
                         f"{problem}; pick another --run-dir or fix its permissions")
