"""`PeerWatch`: one thread per rank that ends the process when the job cannot go on.

Twice a second, on its own connection to the group's store (a short timeout, so a store
that stopped answering cannot block it), the thread
1. checks the launcher (launcher.py): once this worker's launcher is gone, it stops with
   one line: where it stopped and the last committed checkpoint (`--resume auto` goes on
   from there); the run lock goes with the process;
2. writes this rank's heartbeat (liveness.py) and ends this process quietly once another
   rank published a failure (failure.py), as before;
3. reads the peers' heartbeats: a peer gone silent (its process ended without an error of
   its own, or its heartbeat stopped), or, after this rank's collective timed out, a live
   peer that never joined it, is named in one line for the job and every rank stops.

The training loop only sets `Progress.step`; the main thread calls `explain` when one of
its collectives failed, so that the line names the silent rank instead of gloo's text.

A process that leaves its group (`shutdown_distributed`) or ends without an uncaught
exception stops the watches it still runs, and each says DONE: a rank that finished first
and exited would otherwise be named as gone silent by a peer still saving its last
checkpoint (a session started and never closed, several sessions in one process).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from ddp_amp.distributed.failure import EXIT_PEER_FAILED, FAILURE_KEY, claim_failure
from ddp_amp.distributed.launcher import LauncherCheck
from ddp_amp.distributed.liveness import (DONE, FAILED, RUNNING, SILENCE_S, PeerTracker, Progress,
                                          collective_failure, own_beat, publish_beat, read_beats, silent_line)
from ddp_amp.env import DistEnv

STORE_TIMEOUT_S = 5.0  # the watch's own store calls: a live store answers in milliseconds
STORE_DOWN_POLLS = 3  # consecutive polls the store's server refused connections: it is gone
SETTLE_S = 2.0  # after a collective timed out, how long the other ranks get to say theirs did too
# torchrun looks at its workers every 0.1 s (--monitor-interval) and names the first it saw
# fail as the root cause: a survivor that ended at once would take the dead rank's place.
LAUNCHER_SEES_S = 1.0


class PeerWatch:
    """A daemon thread watching the launcher and the peers; see the module docstring."""

    def __init__(self, store: dist.Store | None, env: DistEnv, progress: Progress | None = None,
                 interval_s: float = 0.5, silence_s: float = SILENCE_S) -> None:
        self.store = store if env.world_size > 1 else None
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size
        self.progress = progress if progress is not None else Progress()
        self.interval_s, self.silence_s = interval_s, silence_s
        self.launcher = LauncherCheck(env, self.store)
        self.tracker = PeerTracker(self.rank, self.world_size, time.monotonic(), silence_s)
        self._client: dist.Store | None = None  # None while the store is not answering
        self._failed: tuple[str, float] | None = None  # this rank's collective failed: kind, when
        self._count = 0
        self._store_down = 0
        self._store_lost = False
        self._wake = threading.Event()
        self._stopping = False
        self._gave_up = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeerWatch:
        if self.store is None and self.launcher.parent_pid is None:
            return self  # a single process of its own: nothing to watch
        self._client = _own_connection(self.store) if self.store is not None else None
        self._thread = threading.Thread(target=self._watch, name="ddp_amp-peer-watch", daemon=True)
        self._thread.start()
        _RUNNING.add(self)
        return self

    def stop(self, done: bool = True) -> None:
        """End the thread; with `done`, this rank's last heartbeat says it is done (its peers
        may still be finishing: an exit after a finished run is no silence). Without, a
        process that ends next is taken for a silent rank: for a process that failed."""
        _RUNNING.discard(self)
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._thread = None
        if done and self._client is not None:
            with contextlib.suppress(Exception):  # a store that is gone: the run is over anyway
                self._beat(self._client, DONE)

    def explain(self, error: BaseException, show_error: bool = False) -> None:
        """After a collective of this rank failed (a peer's connection ended, or it timed
        out): wait until the watch names the silent peers (it prints the line for the job
        and ends this process), or until it is clear that no peer is silent (then return).

        `show_error`: print the error's traceback first (--debug). Other errors return at once.
        """
        kind = collective_failure(error)
        if kind is None or self._thread is None or self.store is None:
            return
        if show_error:
            traceback.print_exception(error, file=sys.stderr)
        self._failed = (kind, time.monotonic())
        self._wake.set()
        self._gave_up.wait(self.silence_s + SETTLE_S + 4 * self.interval_s)

    # -- the thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping:
            self._poll(time.monotonic())
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _poll(self, now: float) -> None:
        if self.launcher.parent_gone():  # first: it needs no store, which may have gone with it
            self._stop_orphaned(self.launcher.describe_parent(), prints=self.local_rank == 0)
        if self.store is None or self._store_lost:
            if self._store_lost and self._failed is not None:
                self._store_host_gone()
            return
        if self._client is None:
            self._reconnect()
        client = self._client
        if client is None:  # not reconnected
            return
        try:
            self._exchange(client, now)
        except Exception:  # noqa: BLE001 - a store that stopped answering: probe it quietly from now on
            self._client = None
            self._reconnect()

    def _beat(self, client: dist.Store, state: str) -> None:
        publish_beat(client, self.rank,
                     own_beat(self._count, self.progress.step, state, self.tracker.machine))
        self._count += 1

    def _exchange(self, client: dist.Store, now: float) -> None:
        self._beat(client, RUNNING if self._failed is None else FAILED)
        if client.check([FAILURE_KEY]) and json.loads(client.get(FAILURE_KEY)).get("rank") != self.rank:
            _exit()  # another rank failed and said so
        self.tracker.update(read_beats(client, self.tracker.peers), now)
        gone = self.tracker.gone(now)
        if gone:  # read again after seeing them gone: one that finished said so before it exited
            self.tracker.update(read_beats(client, gone), now)
            gone = self.tracker.gone(now)
        stalled: list[int] = []
        if self._failed is not None and self._failed[0] == "timeout" and now - self._failed[1] >= SETTLE_S:
            stalled = self.tracker.not_joined(now)
        if gone or stalled:
            line = silent_line(gone, stalled, self._steps())
            if claim_failure(client, self.rank, line):  # of several ranks that see it, one prints
                _say(line)
                if gone:  # let the launcher see the dead rank end first: it is the root cause
                    time.sleep(LAUNCHER_SEES_S)
            _exit()
        if self._failed is not None and now - self._failed[1] > self.silence_s + SETTLE_S:
            self._gave_up.set()  # no peer is silent: the error is the main thread's to report

    def _reconnect(self) -> bool:
        """After a failed store call: a new connection where the server still listens. Where
        it refused connections for STORE_DOWN_POLLS polls, its host is gone: a launcher that
        hosted it ends this worker; rank 0 that hosted it (srun) is named once a collective
        fails here (a finished rank 0 exits before the others: no reason to stop then)."""
        if self.store is not None and self.launcher.store_answers() is not False:
            try:
                self._client = _own_connection(self.store)
                self._store_down = 0
                return True
            except Exception:  # noqa: BLE001 - counted below
                pass
        self._store_down += 1
        if self._store_down >= STORE_DOWN_POLLS:
            if self.launcher.store_by_launcher:  # each node's first worker says it for its node
                self._stop_orphaned(self.launcher.describe_store(), prints=self.local_rank == 0)
            self._store_lost = True
        return False

    def _store_host_gone(self) -> None:
        """A collective failed here after rank 0's store went away with rank 0's process."""
        if self.rank == 1:  # no store left to agree on who says it: the lowest other rank does
            _say(silent_line([0], [], self._steps()))
        _exit()

    def _stop_orphaned(self, what: str, prints: bool) -> None:
        if prints:
            step, checkpoint = self.progress.step, self.progress.checkpoint
            where = f"; stopping at step {step}" if step is not None else "; stopping"
            if checkpoint is not None:  # a newer one may have committed as the launcher died
                where += f"; checkpoint {checkpoint} is committed (--resume auto continues from the newest)"
            elif step is not None:
                where += "; no checkpoint was committed yet"
            _say(f"ddp_amp: rank {self.rank}: {what}{where}")
        _exit()

    def _steps(self) -> dict[int, int | None]:
        return {**{rank: self.tracker.step(rank) for rank in self.tracker.peers}, self.rank: self.progress.step}


_RUNNING: set[PeerWatch] = set()  # the watches this process started and has not stopped


def stop_watches(finished: bool = True) -> None:
    """Stop every watch of this process; `finished`: each says DONE (see `PeerWatch.stop`)."""
    for watch in list(_RUNNING):
        watch.stop(done=finished)


def _stop_watches_at_exit() -> None:
    # An exception that reached the top of the program is recorded before atexit runs: that
    # process failed, and its peers are right to name it once it is gone.
    stop_watches(finished=getattr(sys, "last_value", None) is None)


atexit.register(_stop_watches_at_exit)


def _own_connection(store: dist.Store) -> dist.Store:
    """A second client of the group's store with a short timeout; the store itself where it
    cannot be cloned (a store made by someone else)."""
    try:
        client = store.clone()  # type: ignore[attr-defined]  # Store.clone is missing from torch's stubs
    except (RuntimeError, AttributeError):
        return store
    client.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return client


def _say(line: str) -> None:
    try:
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
    except OSError:  # the reader of our output may be gone with the launcher
        pass


def _exit() -> None:
    """End this process now: its main thread may be blocked in a collective."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
    os._exit(EXIT_PEER_FAILED)
