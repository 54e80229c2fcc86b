"""`PeerWatch`: one thread per rank that ends the process when the job cannot go on.

Every poll (`--watch-poll`, 0.5 s), the thread
1. checks the launcher (launcher.py): once this worker's launcher is gone, it stops with
   one line: where it stopped and the last committed checkpoint (`--resume auto` goes on
   from there); the run lock goes with the process;
2. tells the rank's heartbeat helper (heartbeat.py, through heart.py) its state, and reads
   its news: another rank's failure (failure.py) ends this process quietly; a store that
   refuses connections while its host had not finished ends it with one line (a store
   hosted by rank 0 under plain srun goes with rank 0: the others must not be stranded);
3. on a judge (ranks 0 and 1), every beat period, reads every rank's beat in batches: a
   rank gone silent (its process ended without an error of its own, or its heartbeat
   stopped), or, once a rank's collective timed out, a live rank that never joined it (or
   one that never arrived), is named in one line for the job, and the failure published
   ends every rank; the named rank's own helper ends it, so a launcher reports it as the
   root cause.
The store's work per rank is one beat per beat period (liveness.py) and the judges' reads,
which grow linearly with the number of ranks (a few ms of a judge's CPU per read at 16,384
ranks). Two judges: one stopped, or hung with the GIL held, does not leave the job unwatched.

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
import os
import sys
import threading
import time
import traceback

import torch.distributed as dist

from ddp_amp.distributed.failure import EXIT_PEER_FAILED
from ddp_amp.distributed.heart import Heart
from ddp_amp.distributed.launcher import LauncherCheck
from ddp_amp.distributed.liveness import (BEATS_PER_S, POLL_S, SILENCE_S, Liveness, PeerTracker, Progress,
                                          collective_failure, store_route)
from ddp_amp.distributed.naming import silent_line
from ddp_amp.distributed.store_keys import (BEAT_KEY, DONE, FAILED, FAILURE_KEY, GONE, RUNNING, TIMED_OUT,
                                            announce, beat, failure_value)
from ddp_amp.distributed.store_wire import WireClient
from ddp_amp.env import DistEnv

SETTLE_S = 2.0  # after a collective timed out, how long the other ranks get to say theirs did too
# torchrun looks at its workers every 0.1 s (--monitor-interval) and names the first it saw
# fail as the root cause: a survivor that ended at once would take the dead rank's place.
LAUNCHER_SEES_S = 1.0
JUDGES = (0, 1)


class PeerWatch:
    """A daemon thread watching the launcher and the peers; see the module docstring."""

    def __init__(self, store: dist.Store | None, env: DistEnv, progress: Progress | None = None,
                 interval_s: float = POLL_S, silence_s: float = SILENCE_S, beats_per_s: float = BEATS_PER_S) -> None:
        self.store = store if env.world_size > 1 else None
        self.env = env
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size
        self.progress = progress if progress is not None else Progress()
        self.liveness = Liveness(interval_s, silence_s, beats_per_s)
        self.interval_s = interval_s
        self.beat_s = self.liveness.beat_s(self.world_size)  # also the judges' period
        self.silence_s = self.liveness.silence_for(self.world_size)
        self.launcher = LauncherCheck(env, self.store)
        self.route = store_route(self.store)
        self.judge = self.rank in JUDGES and self.route is not None
        self.tracker = PeerTracker(self.rank, self.world_size, self.silence_s)
        self.judge_cpu_s = 0.0  # the CPU this rank spent judging (the scale benchmark reports it)
        self._next_judge = 0.0
        self.heart: Heart | None = None
        self._told = ""  # the state the helper was last told
        self._wire: WireClient | None = None  # the judge's connection; None while not answering
        self._beat_reads: list[tuple[bytes, int]] = []  # the judge's requests for every beat
        self._failed: tuple[str, float] | None = None  # this rank's collective failed: kind, when
        self._host_done = False
        self._store_lost = False
        self._wake = threading.Event()
        self._stopping = False
        self._gave_up = threading.Event()
        self._ending = threading.Lock()  # held by the one thread that says why this process stops
        self._thread: threading.Thread | None = None

    def start(self) -> PeerWatch:
        if self.store is None and self.launcher.parent_pid is None:
            return self  # a single process of its own: nothing to watch
        if self.route is not None:
            self.heart = start_heart(self.store, self.env, self.liveness, self.progress)
            notice = self.liveness.notice(self.world_size)
            if notice is not None and self.rank == 0:  # limits widened past the ones set: said once, by rank 0
                with contextlib.suppress(OSError):
                    print(notice, file=sys.stderr, flush=True)
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
        self._stopping, self.heart = True, None  # no more states told, no news read
        self._wake.set()
        self._thread.join()
        self._thread = None
        stop_heart(self.rank, done)
        if self._wire is not None:
            self._wire.close()

    def explain(self, error: BaseException, show_error: bool = False) -> None:
        """After a collective of this rank failed (a peer's connection ended, or it timed
        out): wait until a judge names the silent peers (the failure it publishes ends this
        process), or until it is clear that no peer is silent (then return).

        A launcher found gone ends this process at once with the watch's line: its store went
        with it, so the error is likely the store's, met by the loop before the next poll.

        `show_error`: print the error's traceback first (--debug). Other errors return at once.
        """
        if self._thread is not None and self.launcher.parent_gone():
            self._stop_orphaned(self.launcher.describe_parent(), prints=self.local_rank == 0)
        kind = collective_failure(error)
        if kind is None or self._thread is None or self.store is None:
            return
        if show_error:
            traceback.print_exception(error, file=sys.stderr)
        self._failed = (kind, time.monotonic())
        self._wake.set()
        self._gave_up.wait(self.silence_s + SETTLE_S + 2 * self.beat_s + 6 * self.interval_s)

    # -- the thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping:
            self._poll(time.monotonic())
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _poll(self, now: float) -> None:
        if self.launcher.parent_gone():  # first: it needs no store, which may have gone with it
            self._stop_orphaned(self.launcher.describe_parent(), prints=self.local_rank == 0)
        heart = self.heart
        if heart is None:
            return
        state = self._state()
        if state != self._told:
            heart.tell(state)
            self._told = state
        for news in heart.news():
            self._hear(news)
        if self.judge and not self._store_lost and now >= self._next_judge:
            self._next_judge = now + self.beat_s
            started = time.thread_time()
            try:
                self._judge(now)
            finally:
                self.judge_cpu_s += time.thread_time() - started
        if self._failed is not None and \
                now - self._failed[1] > self.silence_s + SETTLE_S + 2 * self.beat_s + 4 * self.interval_s:
            self._gave_up.set()  # no peer is silent: the error is the main thread's to report

    def _state(self) -> str:
        if self._failed is None:
            return RUNNING
        return TIMED_OUT if self._failed[0] == "timeout" else FAILED

    def _hear(self, news: str) -> None:
        """A line of the helper's: F <rank that failed>, H (the store's host finished), L (store lost)."""
        if news.startswith("F "):
            if news[2:].strip() == str(self.rank):
                return  # this rank's own failure: its main thread reports it
            _exit()  # another rank failed and said so
        elif news == "H":
            self._host_done = True
        elif news == "L":
            self._store_lost = True
            if self.launcher.store_by_launcher:  # each node's first worker says it for its node
                self._stop_orphaned(self.launcher.describe_store(), prints=self.local_rank == 0)
            elif self._failed is not None:
                self._store_host_gone()
            elif not self._host_done:  # rank 0 left without finishing: nothing can go on
                first_left = self.local_rank == 0 or (self.env.node_rank == 0 and self.local_rank == 1)
                self._stop_orphaned(self.launcher.describe_store(), prints=first_left)

    def _judge(self, now: float) -> None:
        if self._wire is None:
            try:
                host, port, prefix = self.route  # type: ignore[misc]  # judge implies a route
                self._wire = WireClient(host, port, prefix)
                self._beat_reads = self._wire.batched_requests([f"{BEAT_KEY}{r}" for r in self.tracker.ranks])
            except OSError:
                self._wire = None
                return
        try:
            self.tracker.update(self._wire.read_batched(self._beat_reads), now)
            gone = self.tracker.gone(now)
            if gone:  # read again after seeing them gone: one that finished said so before it exited
                keys = [f"{BEAT_KEY}{r}" for r in gone]
                self.tracker.update(self._wire.read_batched(self._wire.batched_requests(keys)), now, gone)
                gone = self.tracker.gone(now)
            stalled = [r for r in self.tracker.not_joined(now, SETTLE_S) if r not in gone]
            absent = self.tracker.never_arrived(now, SETTLE_S)
            named = gone + stalled + absent
            if not named:
                return
            line = silent_line(gone, stalled, self._steps(), absent)
            value = failure_value(self.rank, line, named, self.tracker.since(named, now))
            claimed = self._wire.compare_set(FAILURE_KEY, b"", value) == value
        except OSError:  # the store is busy or gone: the helper tells which
            self._wire = None
            return
        if claimed:  # of the judges that see it, one prints; then every rank hears of it
            _say(line)
            with contextlib.suppress(OSError):
                announce(self._wire)
            time.sleep(LAUNCHER_SEES_S)  # the named rank's helper ends it first: the launcher's root cause
        _exit()

    def _store_host_gone(self) -> None:
        """A collective failed here after rank 0's store went away with rank 0's process."""
        if self.rank == 1:  # no store left to agree on who says it: the lowest other rank does
            _say(silent_line([0], [], self._steps()))
        _exit()

    def _stop_orphaned(self, what: str, prints: bool) -> None:
        # The watch thread and the main thread (explain) may both find the launcher gone: the
        # first prints and ends the process, the second waits here for that end.
        self._ending.acquire()
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
        return {**{rank: self.tracker.step(rank) for rank in self.tracker.ranks}, self.rank: self.progress.step}


_RUNNING: set[PeerWatch] = set()  # the watches this process started and has not stopped
_HEARTS: dict[int, Heart] = {}  # this process's heartbeat helper, by rank
_FOLLOWERS: dict[int, Progress] = {}  # the Progress whose step each helper's page holds, by rank


def start_heart(store: dist.Store | None, env: DistEnv, liveness: Liveness | None = None,
                progress: Progress | None = None) -> Heart | None:
    """Start this rank's heartbeat helper (as the group forms: a rank's silence clock starts
    at its first beat), or return the one running at these limits; from now on `progress`'s
    step is the one its beats carry."""
    route = store_route(store) if env.world_size > 1 else None
    if route is None:
        return None
    limits = liveness if liveness is not None else Liveness()
    beat_s = limits.beat_s(env.world_size)
    heart = _HEARTS.get(env.rank)
    if heart is None or (heart.poll_s, heart.beat_s) != (limits.poll_s, beat_s):
        if heart is not None:
            _end_heart(env.rank, None)  # without a last word: the new helper takes over
        is_host = env.rank == 0 and not env.agent_hosts_store
        if store is not None and heart is None:  # the first beat now: a rank that ends before its
            store.set(f"{BEAT_KEY}{env.rank}", beat("0", "-", RUNNING).decode())  # its helper runs is known
        heart = _HEARTS[env.rank] = Heart(route, env.rank, beat_s, limits.poll_s, is_host)
    if progress is not None and _FOLLOWERS.get(env.rank) is not progress:
        previous = _FOLLOWERS.get(env.rank)
        if previous is not None:
            previous.mirror_to(None)
        _FOLLOWERS[env.rank] = progress
        progress.mirror_to(heart.page)
    return heart


def stop_heart(rank: int, done: bool) -> None:
    """End `rank`'s helper after a last beat that says the rank is done, or, without `done`,
    that it ended without saying so (it failed: its peers name it at once, unless its own
    error was published first)."""
    _end_heart(rank, DONE if done else GONE)


def _end_heart(rank: int, state: str | None) -> None:
    heart = _HEARTS.pop(rank, None)
    follower = _FOLLOWERS.pop(rank, None)
    if follower is not None:
        follower.mirror_to(None)  # before the page is unmapped
    if heart is not None:
        heart.stop(state)


def stop_watches(finished: bool = True) -> None:
    """Stop every watch of this process, and its helpers; `finished`: each says DONE (see
    `PeerWatch.stop`)."""
    for watch in list(_RUNNING):
        watch.stop(done=finished)
    for rank in list(_HEARTS):
        stop_heart(rank, finished)


def _stop_watches_at_exit() -> None:
    # An exception that reached the top of the program is recorded before atexit runs: that
    # process failed, and its peers are right to name it once it is gone.
    stop_watches(finished=getattr(sys, "last_value", None) is None)


atexit.register(_stop_watches_at_exit)


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
