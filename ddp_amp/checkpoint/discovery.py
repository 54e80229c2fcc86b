"""Where checkpoints live and which one to resume from.

Layout: `<run_dir>/checkpoints/step-NNNNNNNN/` (zero-padded, so names sort by step). A
directory counts only once its manifest verifies; `--resume auto` walks from the newest
step down and skips torn or corrupted ones with a warning naming them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ddp_amp.checkpoint.manifest import IncompleteCheckpoint
from ddp_amp.checkpoint.verify import verify_checkpoint
from ddp_amp.errors import UsageError

STEP_DIR = re.compile(r"^step-(\d{8,})$")
# Scratch directories of writes under way (or killed), and a committed directory moved
# aside for a moment while the same name is saved again (see commit._move_into_place).
SCRATCH_PREFIX = ".tmp-"
ASIDE_PREFIX = ".tmp-old-"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """N for a `step-N` directory, else None."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-N` directory under `root`, oldest first; no checks."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


ASIDE_DIR = re.compile(r"^\.tmp-old-step-(\d{8,})-\d+$")


def complete_copy(target: Path, warn: Callable[[str], None]) -> Path | None:
    """`target` if it is a complete checkpoint, else a complete copy a crash left set aside.

    A save that replaces `target` moves the old directory aside for a moment; a crash in
    that moment leaves the old one under its aside name, and it is still good.
    """
    for path in [target, *sorted(target.parent.glob(f"{ASIDE_PREFIX}{target.name}-*"), reverse=True)]:
        if not path.exists():
            continue
        try:
            verify_checkpoint(path)
        except IncompleteCheckpoint as reason:
            warn(f"skipping incomplete checkpoint {path}: {reason}")
            continue
        return path
    return None


def _candidates(root: Path) -> list[Path]:
    """Newest first: `step-N` dirs, plus any complete one a crash caught set aside while the
    same step was being re-saved (see commit._move_into_place); a real `step-N` wins a tie."""
    ranked = [(step, 1, path) for step, path in list_step_dirs(root)]
    if root.is_dir():
        for entry in root.iterdir():
            match = ASIDE_DIR.match(entry.name)
            if match and entry.is_dir():
                ranked.append((int(match.group(1)), 0, entry))
    return [path for _, _, path in sorted(ranked, reverse=True)]


def candidate_dirs(root: Path) -> list[Path]:
    """Every checkpoint directory under `root` a resume may take, newest first, unverified."""
    return _candidates(root)


def copies_of(target: Path) -> list[Path]:
    """`target` and the copies a crash during a re-save left set aside, those that exist,
    in the order `complete_copy` tries them; unverified."""
    return [path for path in [target, *sorted(target.parent.glob(f"{ASIDE_PREFIX}{target.name}-*"), reverse=True)]
            if path.exists()]


def resume_candidates(choice: str, root: Path) -> tuple[list[Path], bool]:
    """`--resume auto|PATH`'s checkpoint directories, newest first and unverified, and whether
    the choice named one directory (refused if it fails) rather than a folder of them (the
    next older one is taken). UsageError for a PATH that does not exist."""
    if choice == "auto":
        return _candidates(root), False
    path = Path(choice)
    if not path.exists():
        raise UsageError("--resume", choice, "an existing checkpoint directory",
                         f"use --resume auto to pick the newest in {root}, or --resume none")
    if not (path / "manifest.json").exists() and path.is_dir() and list_step_dirs(path):
        return _candidates(path), False
    return [path], True


def newest_complete(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint under `root` whose manifest verifies; warns about each one skipped."""
    candidates = _candidates(root)
    for path in candidates:
        try:
            verify_checkpoint(path)
        except IncompleteCheckpoint as reason:
            warn(f"skipping incomplete checkpoint {path}: {reason}; trying the next older one")
            continue
        return path
    return None


def resolve_resume(choice: str, root: Path, warn: Callable[[str], None]) -> Path | None:
    """Turn `--resume auto|none|PATH` into a verified checkpoint directory, or None to start fresh.

    A PATH may name a `step-N` directory or a `checkpoints/` folder (its newest complete one).
    """
    if choice == "none":
        return None
    if choice == "auto":
        return newest_complete(root, warn)
    path = Path(choice)
    if not path.exists():
        raise UsageError("--resume", choice, "an existing checkpoint directory",
                         f"use --resume auto to pick the newest in {root}, or --resume none")
    if not (path / "manifest.json").exists() and path.is_dir() and list_step_dirs(path):
        chosen = newest_complete(path, warn)
        if chosen is None:
            raise UsageError("--resume", choice, "a folder holding a complete checkpoint",
                             "every step-N in it failed its manifest check (see the warnings)")
        return chosen
    try:
        verify_checkpoint(path)
    except IncompleteCheckpoint as reason:
        raise UsageError("--resume", choice, "a complete checkpoint directory (step-N with a "
                         "manifest.json)", str(reason)) from None
    return path
