"""Retention (`--keep-last`): old checkpoints go only after a new one is committed, and in the
background, so no rank waits while thousands of shard files are deleted.

In the commit, rank 0 only renames each checkpoint to let go to a `.tmp-retired-` name (one
metadata operation each): from that moment no resume takes it, and a deletion cut short
leaves nothing that looks like a torn checkpoint. A thread of rank 0's then deletes them
while training goes on. One deletion runs at a time: the next commit waits for the previous
one first, so the two never touch the same directory. A deletion that fails is a warning
(the space is not freed; nothing needed is lost), and what it left is cleared with the
other `.tmp-` leftovers at the next commit.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from ddp_amp.checkpoint.best import protected_directory
from ddp_amp.checkpoint.discovery import SCRATCH_PREFIX, list_step_dirs

log = logging.getLogger(__name__)
RETIRED_PREFIX = f"{SCRATCH_PREFIX}retired-"


def doomed_checkpoints(root: Path, keep_last: int, newest: Path) -> list[Path]:
    """The checkpoints under `root` that retention lets go once `newest` is committed: all but
    `newest` and the `keep_last - 1` just older than it (0 keeps all) and the best one.

    Directories with a higher step than `newest` (left by an earlier run or skipped as
    corrupt) are not touched: this run did not write them.
    """
    if keep_last < 1:
        return []
    steps = list_step_dirs(root)
    newest_step = next((step for step, path in steps if path == newest), None)
    if newest_step is None:
        return []
    best = protected_directory(root)  # --keep-best's checkpoint stays, and counts apart
    older = [path for step, path in steps if step < newest_step and path != best]
    return older[:max(0, len(older) - (keep_last - 1))]


def _retire(path: Path) -> Path | None:
    """Rename `path` out of discovery's sight; the new name, or None where that failed."""
    if path.name.startswith(RETIRED_PREFIX):  # what an earlier deletion left: out of sight already
        return path
    retired = path.with_name(f"{RETIRED_PREFIX}{path.name.removeprefix(SCRATCH_PREFIX)}-{os.getpid()}")
    try:
        os.rename(path, retired)
    except OSError as error:
        log.warning("retention could not remove %s (%s); it stays, and resumes may still take it", path,
                    error.strerror or error)
        return None
    return retired


def _delete(paths: list[Path]) -> None:
    """The deleting thread's body: every failure a warning, never an exception."""
    failed: list[str] = []

    def note(_function: object, name: str, info: tuple[object, BaseException, object]) -> None:
        failed.append(f"{name}: {info[1]}")

    for path in paths:
        failed.clear()
        # onerror, not 3.12's onexc: the oldest Python supported has only this one
        shutil.rmtree(path, onerror=note)
        if failed:
            log.warning("retention could not delete all of %s (%s); the next checkpoint's commit tries again",
                        path, failed[0])
        else:
            log.debug("retention removed %s", path)


class Retention:
    """Rank 0's retention of one run's checkpoints: at most one deletion in flight."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def wait(self) -> None:
        """Let the deletion in flight, if any, finish (before the next commit touches the folder)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def apply(self, root: Path, keep_last: int, newest: Path, background: bool = True,
              also: list[Path] | None = None) -> list[Path]:
        """Let go of what `doomed_checkpoints` names, and of the directories `also` names (a
        replaced copy, leftovers of killed writes): renamed now, deleted in a thread (or
        here, without `background`). Returns the checkpoints let go, by their names before."""
        self.wait()
        doomed = doomed_checkpoints(root, keep_last, newest)
        let_go = list(dict.fromkeys([*doomed, *(also or [])]))  # each once, in order
        retired = [moved for moved in map(_retire, let_go) if moved is not None]
        if retired and background:
            # Not a daemon: an exiting interpreter lets the deletion finish rather than cut it.
            self._thread = threading.Thread(target=_delete, args=(retired,), name="ddp_amp checkpoint retention")
            self._thread.start()
        elif retired:
            _delete(retired)
        return doomed


def apply_retention(root: Path, keep_last: int, newest: Path) -> list[Path]:
    """Keep `newest` and the `keep_last - 1` checkpoints just older than it (0 keeps all) and
    the best one; delete the others now, in the calling thread."""
    return Retention().apply(root, keep_last, newest, background=False)
