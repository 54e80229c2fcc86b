"""Checkpoints written in the background: training waits only for a host copy and one broadcast.

`BackgroundSaver.start` (collective) does in the foreground what needs the live state: each
rank captures its RNG state; rank 0 checks that every value will load back, copies its state
off the device (`staging.HostStaging`: the next optimizer step changes the live tensors in
place) and makes the scratch directory, whose path every rank learns; a sharded state's
write starts (DCP's async save). Then a writer thread on every rank writes that rank's own
files, and the ranks' reports are exchanged over a process group of the saves' own
(training's collectives go on meanwhile; gloo, connecting each pair of ranks only where a
collective joins them: an all-reduce, a ring, joins each rank to two); rank 0's thread
commits with the synchronous save's own steps (`save.commit_reported`,
`save.commit_outcome`), so the commit protocol, the manifest and retention are the same in
both modes.

At most one write is in flight. `wait` (collective) joins it on every rank and tells every
rank its outcome through `distributed.on_rank_zero`, so a failed background write reaches every
rank at the same point of the loop, as the error of a synchronous save would. On a
failure path a peer may be gone, so `join_locally` only lets this rank's writer finish or
fail before the process exits; one that never finishes leaves a `.tmp-` directory, which no
reader takes for a checkpoint, and every committed checkpoint untouched.

Not torch.distributed.checkpoint's async save: that writes a second on-disk format with
its own metadata and commit rules. Building on this writer keeps one commit protocol,
manifest and retention for both modes, and resume (including mapping the data position
onto another world size) reads the same directory whichever mode wrote it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_amp.checkpoint.manifest import SHARDED_DIR
from ddp_amp.checkpoint.meta import Meta
from ddp_amp.checkpoint.rank_files import write_own_files
from ddp_amp.checkpoint.rank_reports import exchange_reports
from ddp_amp.checkpoint.retention import Retention
from ddp_amp.checkpoint.rng import capture_rng
from ddp_amp.checkpoint.save import Committed, commit_outcome, commit_reported, prepare, scratch_folders, this_rank
from ddp_amp.checkpoint.shard_writer import BackgroundShards
from ddp_amp.checkpoint.staging import HostStaging
from ddp_amp.distributed import on_rank_zero
from ddp_amp.errors import CheckpointError


@dataclass(frozen=True)
class FinishedWrite:
    """A background write's outcome, the same on every rank: the path, or why there is none."""

    target: Path
    path: Path | None
    error: CheckpointError | None
    write_s: float  # rank 0's time from the thread's start to the commit (or the failure)
    retired: tuple[str, ...] = ()  # what retention retired in the commit: each rank deletes its own files of them


@dataclass
class _Write:
    """One write in flight: its target and its writer thread on every rank, the outcome on rank 0."""

    target: Path
    thread: threading.Thread | None = None
    outcome: Committed | None = None
    error: BaseException | None = None
    seconds: float = 0.0

    def start(self, work: Callable[[], Committed | None]) -> None:
        """Run `work` (the write) in a thread of its own; not a daemon: the interpreter lets
        it finish before exiting."""
        self.thread = threading.Thread(target=self._run, args=(work,),
                                       name=f"ddp_amp checkpoint writer ({self.target.name})")
        self.thread.start()

    def _run(self, work: Callable[[], Committed | None]) -> None:
        """The writer thread's body: keep whatever happened for `result`."""
        started = time.perf_counter()
        try:
            self.outcome = work()
        except BaseException as error:  # noqa: BLE001 - raised on every rank where the outcome is learned
            self.error = error
        finally:
            self.seconds = time.perf_counter() - started

    def result(self) -> tuple[str | None, CheckpointError | None, list[str], float]:
        """Rank 0: wait for the thread; its (path, disk failure, retired, seconds), or its error raised."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        if self.outcome is None:  # staging failed before a thread started: start() raised then
            raise RuntimeError(f"checkpoint {self.target}: no writer ran, so there is no outcome to learn")
        return (*self.outcome, self.seconds)


class BackgroundSaver:
    """`--async-checkpoint`'s writer: one checkpoint write in flight at most."""

    def __init__(self) -> None:
        self._staging = HostStaging()
        self._write: _Write | None = None

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint whose write was started and whose outcome is not learned yet (every rank)."""
        return self._write.target if self._write is not None else None

    def start(self, target: Path, files: dict[str, Any], meta: Meta, device: torch.device, world_size: int,
              keep_last: int, group: Any, retention: Retention | None = None,
              sharded: dict[str, Any] | None = None, values: dict[str, Any] | None = None) -> None:
        """Start writing the checkpoint `target` (collective); returns once it is copied and
        a sharded state's write has started.

        `files`, `meta`, `keep_last`, `sharded` and `values` as for `save.save_checkpoint`; `group`: the
        saves' own process group (None without one). A value that would not load back
        raises UsageError on every rank, as there. Call `wait` for the previous write first.
        """
        if self._write is not None:
            raise RuntimeError(f"checkpoint {self._write.target} is still being written: wait() first")
        rng_state = capture_rng(device)  # fresh objects: nothing to copy
        contents: dict[str, Any] = {}  # rank 0's files, copied off the live state
        folders = scratch_folders(sharded is not None, bool(values))
        path, failure = on_rank_zero(lambda: prepare(target, self._staging.copy(files), meta, world_size, contents,
                                                     folders))
        write = _Write(target)
        if path is None:  # the disk refused the scratch directory: learned at `wait`, as a failed write is
            write.outcome = (None, failure, [])
            self._write = write
            return
        scratch, rank = Path(path), this_rank()
        shards = BackgroundShards(scratch / SHARDED_DIR, sharded, group) if sharded is not None else None

        def work() -> Committed | None:
            if retention is not None:
                retention.wait()  # this rank's files of what the last commit retired are gone before it reports
            report = write_own_files(scratch, rank, rng_state, shards.records if shards is not None else None, values)
            reports = exchange_reports(report, torch.device("cpu"), group)  # the saves' group: gloo, on the CPU
            if reports is None:  # not rank 0: rank 0 commits
                return None
            return commit_reported(target, scratch, reports, contents,
                                   shards.writer.map_record() if shards is not None else {}, folders, keep_last,
                                   retention, outcome=commit_outcome)

        write.start(work)
        self._write = write

    def wait(self) -> FinishedWrite | None:
        """The outcome of the write in flight, on every rank (collective); None if none is."""
        write, self._write = self._write, None
        if write is None:
            return None
        if write.thread is not None:  # a writer runs on every rank: each its own first
            write.thread.join()
        path, error, retired, seconds = on_rank_zero(write.result)
        return FinishedWrite(write.target, Path(path) if path else None, error, seconds, tuple(retired))

    def join_locally(self) -> None:
        """On a failure path: let this rank's writer finish or fail, talking to no other rank."""
        write, self._write = self._write, None
        if write is not None and write.thread is not None:
            write.thread.join()
