"""Retention (`--keep-last`): old checkpoints go only after a new one is committed, each rank
deleting its own files of them, so nothing rank 0 does for it grows with the number of ranks.

1. In the commit, rank 0 renames each checkpoint to let go to a `.tmp-retired-` name (one
   metadata operation each): from that moment no resume takes it, and a deletion cut short
   leaves nothing that looks like a torn checkpoint.
2. Those names are part of the commit's outcome, which every rank learns. Each rank then
   deletes, in a thread of its own, the files its record lists there (its RNG file, its
   per-rank values, its shards) and the record (`let_go_own`): no listing, a few files a
   rank. A checkpoint of more ranks than there are now is split as verification splits it:
   rank r of W takes the records of the saved ranks r, r + W, ...
3. Every rank lets its deletion end before it reports its part of the next save, so once
   rank 0 has the exchanged reports, no rank's files are left in the checkpoints retired
   before; rank 0's thread then removes what is left of them (rank 0's files, the empty
   folders, the directory: the same few entries at any world size). At the end of a
   session (`end`, no collective there) rank 0 removes what is left of the last ones
   without that guarantee: it deletes whatever a slower rank has not deleted yet, and each
   tolerates the other's deletions.
A deletion that fails is a warning (the space is not freed; nothing needed is lost); what it
left is removed whole with the other `.tmp-` leftovers at the next commit. Without a run's
`Retention` (`apply_retention`, a single process) what is let go is deleted whole, at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddp_amp.checkpoint.best import protected_directory
from ddp_amp.checkpoint.discovery import SCRATCH_PREFIX, list_step_dirs
from ddp_amp.checkpoint.manifest import IncompleteCheckpoint, ranks_record, read_manifest
from ddp_amp.checkpoint.rank_files import read_record, record_name

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
    """Rename `path` out of discovery's sight; the new name, or None where that failed. The
    name is this retirement's alone: what is left of the last one of the same directory may
    still be there (a checkpoint saved again under one name retires its old copy each time)."""
    retired = path.with_name(f"{RETIRED_PREFIX}{path.name.removeprefix(SCRATCH_PREFIX)}-{os.getpid()}-"
                             f"{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, retired)
    except OSError as error:
        log.warning("retention could not remove %s (%s); it stays, and resumes may still take it", path,
                    error.strerror or error)
        return None
    return retired


def remove_whole(paths: Sequence[Path]) -> None:
    """Delete each directory of `paths` and what is left in it: rank 0's part of retention
    (and all of it where there is no run's `Retention`). Files another rank deletes
    meanwhile are no failure; any other is a warning, never an exception."""
    failed: list[str] = []

    def note(_function: object, name: str, info: tuple[object, BaseException, object]) -> None:
        if not isinstance(info[1], FileNotFoundError):  # gone already: another rank deleted it
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


def _saved_ranks(directory: Path, rank: int, world_size: int) -> range:
    """The saved ranks whose files rank `rank` of `world_size` deletes in retired `directory`."""
    try:
        ranks = ranks_record(read_manifest(directory))
    except IncompleteCheckpoint:  # a write cut short: this rank's own record, where it wrote one
        return range(rank, rank + 1)
    return range(rank, ranks.count, world_size) if ranks is not None else range(0)  # format 1: all rank 0's


def delete_rank_files(directory: Path, rank: int, world_size: int) -> None:
    """Rank `rank`'s part of deleting retired checkpoint `directory`: the files its records
    list, then the records (see the module's docstring). Whatever it cannot read or delete
    is left for rank 0 (a warning where the disk refused)."""
    for saved in _saved_ranks(directory, rank, world_size):
        try:
            record = read_record(directory, saved)
        except IncompleteCheckpoint:  # none, or not one: rank 0 removes what is there
            continue
        try:
            for name in [*record.files, record_name(saved)]:  # the record last: it names the others
                (directory / name).unlink(missing_ok=True)
        except OSError as error:
            log.warning("retention: rank %d could not delete its files of %s (%s); rank 0 removes what is left",
                        rank, directory, error.strerror or error)


def _delete_own(paths: Sequence[Path], rank: int, world_size: int) -> None:
    for path in paths:
        delete_rank_files(path, rank, world_size)


class Retention:
    """One rank's part of retention for a run's checkpoints: its deletions in flight, and on
    rank 0 the retired checkpoints whose remains it removes (see the module's docstring)."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # the writer thread of a background save joins what the main thread started
        self._handed: list[Path] = []  # rank 0: retired by the last commit, for every rank to learn
        self._remains: list[Path] = []  # rank 0: retired, its ranks' files maybe still being deleted

    def _start(self, work: Callable[..., None], *args: Any) -> None:
        # Not a daemon: an exiting interpreter lets the deletion finish rather than cut it.
        thread = threading.Thread(target=work, args=args, name="ddp_amp checkpoint retention")
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def wait(self) -> None:
        """Let this rank's deletions in flight end (before it reports its part of a save, and
        on rank 0 before a commit touches the folder)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()

    def apply(self, root: Path, keep_last: int, newest: Path, background: bool = True,
              also: list[Path] | None = None) -> list[Path]:
        """Rank 0, in the commit: let go of what `doomed_checkpoints` names and of the
        directories `also` names (a replaced copy, leftovers of killed writes), renamed now.
        With `background` each rank deletes its own files of them once it learns their names
        (`take_retired`, `let_go_own`), and what earlier commits retired is removed here, in a
        thread; without, everything let go is deleted here and now. Returns the checkpoints
        let go, by their names before."""
        self.wait()
        doomed = doomed_checkpoints(root, keep_last, newest)
        let_go = list(dict.fromkeys([*doomed, *(also or [])]))  # each once, in order
        # Retired before (by an earlier commit, or a run that ended before its ranks were done):
        # every rank has reported since, so its part is done, and what is left is rank 0's.
        left = list(dict.fromkeys([*self._remains, *(path for path in let_go if path.name.startswith(RETIRED_PREFIX))]))
        retired = [moved for path in let_go if not path.name.startswith(RETIRED_PREFIX)
                   for moved in [_retire(path)] if moved is not None]
        if not background:
            remove_whole([*left, *retired])
            return doomed
        self._handed, self._remains = retired, list(retired)
        if left:
            self._start(remove_whole, left)
        return doomed

    def take_retired(self) -> list[str]:
        """Rank 0: the directories the last commit retired, for the commit's outcome (once)."""
        handed, self._handed = self._handed, []
        return [str(path) for path in handed]

    def let_go_own(self, retired: Sequence[str], rank: int, world_size: int, background: bool = True) -> None:
        """Every rank, once it learned a commit's outcome: delete its own files of the
        `retired` directories, in a thread (or here, without `background`)."""
        if not retired:
            return
        paths = [Path(path) for path in retired]
        if background:
            self._start(_delete_own, paths, rank, world_size)
        else:
            _delete_own(paths, rank, world_size)

    def end(self, remove_remains: bool) -> None:
        """At the end of a session, talking to no other rank: let this rank's deletions end;
        with `remove_remains` (rank 0), remove what is left of the checkpoints retired last."""
        self.wait()
        if remove_remains:
            remains, self._remains = self._remains, []
            remove_whole(remains)


def apply_retention(root: Path, keep_last: int, newest: Path) -> list[Path]:
    """Keep `newest` and the `keep_last - 1` checkpoints just older than it (0 keeps all) and
    the best one; delete the others now, in the calling thread."""
    return Retention().apply(root, keep_last, newest, background=False)
