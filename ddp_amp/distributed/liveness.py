"""Which ranks are alive and making progress: a heartbeat per rank in the group's store.

Each rank's watch thread (`watch.PeerWatch`) writes this rank's heartbeat every poll: a
count that changes each time, the last step the training loop finished (`Progress.step`,
an int the loop sets once per step and the thread reads: the loop itself never touches
the store), whether this rank's last collective failed, and what identifies its process.

The beats are written by each rank's heartbeat helper (heartbeat.py), a process that beats
while the rank's process runs, whatever its threads do; they are read in batches by the
judges (ranks 0 and 1), never by every rank: the store's work per poll grows with the
number of ranks, not with its square.

A peer has *gone silent* when
- it runs on this machine (same boot and pid namespace) and its process is gone, a
  zombie, or its pid now belongs to a newer process: known at the next poll;
- or its heartbeat has not changed for `SILENCE_S` since it was first seen: a process
  killed on another node, a node lost, a process stopped (SIGSTOP);
- or it has not beaten at all `STARTUP_S` after the judge started (its clock starts at its
  first beat: ranks that reach their loop at different times are not silent).
The three limits are a run's options (`Liveness`), the same on every rank.
A peer has *stopped making progress* when this rank's collective timed out and the peer
is alive (its heartbeat goes on) but no collective of its own failed: it never joined.
A rank that finished its run says so in its last heartbeat (DONE) before it exits: the
ranks still finishing do not take its end for silence.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ddp_amp.distributed.store_wire import WireClient
from ddp_amp.errors import UsageError

# A heartbeat unchanged this long means its process is gone. Well above any pause of a
# live process's watch thread (it needs the GIL for a moment every poll), well under the
# 30 s a launcher waits between its SIGTERM and its SIGKILL.
SILENCE_S = 10.0
POLL_S = 0.5
# A rank that never beat this long after the judge started is named: each rank's helper
# starts as the group forms, so only a rank that died before, or cannot start a process, is.
STARTUP_S = 60.0
BEAT_KEY = "ddp_amp/beat/"
# TIMED_OUT: its collective timed out; FAILED: its collective failed as a peer's connection ended.
RUNNING, FAILED, TIMED_OUT, DONE = "r", "f", "t", "d"
BATCH = 100  # beats per multi_get: the libuv server re-parses a pending request per 4 KB read
_PREFIXES: dict[int, str] = {}  # id of a PrefixStore made by group.py -> its prefix

# Words of a collective that failed because a peer's connection ended, or timed out
# (gloo: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer", "Connection reset
# by peer", "[.../unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation";
# NCCL: "Watchdog caught collective operation timeout").
_BACKEND_WORDS = ("gloo", "nccl")
_LOST_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")
_TIMEOUT_WORDS = ("timed out", "timeout")


@dataclass(frozen=True)
class Liveness:
    """How often each rank beats and how long a peer may be silent: the defaults are above;
    `--peer-poll`, `--peer-silence` and `--peer-startup` set them for a run."""

    poll_s: float = POLL_S
    silence_s: float = SILENCE_S
    startup_s: float = STARTUP_S

    def check(self) -> None:
        """One line where the silence limit does not span several polls: a beat or two late
        (a loaded machine) would then name a live rank."""
        if self.silence_s < 4 * self.poll_s:
            raise UsageError("--peer-silence", self.silence_s,
                             f"at least 4 polls ({4 * self.poll_s:g} s at --peer-poll {self.poll_s:g})",
                             "raise --peer-silence or lower --peer-poll")
        if self.startup_s < self.silence_s:
            raise UsageError("--peer-startup", self.startup_s,
                             f"at least --peer-silence ({self.silence_s:g} s)", "raise --peer-startup")


class Progress:
    """What the training loop has done, for the watch thread: plain attributes, no locks.

    `step`: the last step this rank finished (None before its first); `checkpoint`: the
    newest committed checkpoint of the run, as a path (None before the first).

    The step is also written to the rank's heartbeat helper's shared page (`mirror_to`): the
    helper reads it there itself, so a rank whose threads cannot run (a C call holding the
    GIL) still beats with the step it last finished, not the one its watch thread last saw.
    """

    __slots__ = ("_mirror", "_step", "checkpoint")

    def __init__(self) -> None:
        self._step: int | None = None
        self._mirror: memoryview | None = None
        self.checkpoint: str | None = None

    @property
    def step(self) -> int | None:
        return self._step

    @step.setter
    def step(self, value: int | None) -> None:
        self._step = value
        if self._mirror is not None:
            write_step(self._mirror, value)

    def mirror_to(self, page: memoryview | None) -> None:
        """Write the step to `page` from now on (the helper's shared page; None: nowhere)."""
        self._mirror = page
        if page is not None:
            write_step(page, self._step)


def write_step(page: memoryview, step: int | None) -> None:
    """The step as the helper reads it (heartbeat.py's `_read_step`): int64, -1 for none."""
    struct.pack_into("<q", page, 0, -1 if step is None else step)


@dataclass(frozen=True)
class Beat:
    """One heartbeat: `count` changes every poll; the rest says where the rank is."""

    count: int
    step: int | None
    state: str  # RUNNING, FAILED (its last collective failed: a peer lost, a timeout) or DONE
    pid: int
    started: str  # the process's start time, in clock ticks since boot ("" where unknown)
    machine: str  # boot id and pid namespace: pids compare only within one ("" where unknown)

    def encode(self) -> str:
        step = "-" if self.step is None else str(self.step)
        return f"{self.count} {step} {self.state} {self.pid} {self.started or '-'} {self.machine or '-'}"

    @staticmethod
    def decode(raw: bytes) -> Beat | None:
        parts = raw.decode(errors="replace").split(" ")
        if len(parts) != 6:
            return None
        count, step, state, pid, started, machine = parts
        return Beat(int(count), None if step == "-" else int(step), state, int(pid),
                    "" if started == "-" else started, "" if machine == "-" else machine)


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...]; None where unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def this_machine() -> str:
    """Boot id and pid namespace of this process: equal for processes whose pids compare."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def identity(machine: str) -> str:
    """'pid started machine' of this process, as its beats carry them (Beat's last fields)."""
    fields = _stat_fields("self")
    return f"{os.getpid()} {(fields[19] if fields else '') or '-'} {machine or '-'}"


def process_gone(beat: Beat, machine: str) -> bool:
    """True where `beat`'s process ran on this machine and no longer runs (exited, a zombie,
    or its pid reused); False where it runs or cannot be told from here."""
    if not machine or beat.machine != machine or not beat.started:
        return False
    fields = _stat_fields(beat.pid)
    return fields is None or fields[0] in ("Z", "X") or fields[19] != beat.started


def remember_prefix(store: dist.PrefixStore, prefix: str) -> None:
    """Note the prefix of a store group.py made: the helper and the judge speak to the
    TCPStore under it directly (torch's PrefixStore does not tell its prefix)."""
    _PREFIXES[id(store)] = prefix


def store_route(store: dist.Store | None) -> tuple[str, int, str] | None:
    """Host, port and key prefix of the TCPStore under `store`; None where not known."""
    prefix = ""
    if isinstance(store, dist.PrefixStore):
        base: dist.Store = store
        while isinstance(base, dist.PrefixStore):  # torch nests one per group and per prefix
            base = base.underlying_store
        found = _PREFIXES.get(id(store))
        if found is None and isinstance(base, dist.TCPStore):
            found = _find_prefix(store, base)
        if found is None:
            return None
        prefix, store = found, base
    if isinstance(store, dist.TCPStore):
        return store.host, store.port, prefix
    return None


def _find_prefix(store: dist.PrefixStore, base: dist.TCPStore) -> str | None:
    """The prefix of a PrefixStore someone else made (a group a user's script formed with
    `init_process_group`): a probe key written through it, found among the store's keys.
    Once per rank and process group, and only for a group ddp_amp did not form."""
    probe = f"ddp_amp/route-probe/{this_machine()}/{os.getpid()}"
    try:
        store.set(probe, "")
        keys = [key for key in base.list_keys() if key.endswith(probe)]
        store.delete_key(probe)
    except (RuntimeError, dist.DistError, AttributeError):  # a store without list_keys (torch 2.4's): unwatched
        return None
    if len(keys) != 1:
        return None
    prefix = keys[0][:-len(probe)].strip("/")
    _PREFIXES[id(store)] = prefix
    return prefix


def read_beats(client: WireClient, ranks: list[int], batch: int = BATCH) -> dict[int, Beat]:
    """The heartbeats of `ranks` written so far (a rank not yet started has none), in
    requests of `batch` keys: a cost linear in the number of ranks, on the judge alone."""
    beats: dict[int, Beat] = {}
    for start in range(0, len(ranks), batch):
        chunk = ranks[start:start + batch]
        for rank, raw in zip(chunk, client.multi_get([f"{BEAT_KEY}{rank}" for rank in chunk])):
            beat = Beat.decode(raw) if raw else None
            if beat is not None:
                beats[rank] = beat
    return beats


class PeerTracker:
    """Every rank's heartbeat as a judge saw it, and since when each has not changed."""

    def __init__(self, rank: int, world_size: int, now: float, silence_s: float = SILENCE_S,
                 startup_s: float = STARTUP_S) -> None:
        self.ranks = list(range(world_size))
        self.peers = [r for r in self.ranks if r != rank]
        self.silence_s, self.startup_s, self.started = silence_s, startup_s, now
        self.machine = this_machine()
        self.beats: dict[int, Beat] = {}
        self.changed: dict[int, float] = {}  # a rank's silence clock starts at its first beat
        self.timed_out_since: float | None = None  # when a rank first said its collective timed out

    def update(self, beats: dict[int, Beat], now: float) -> None:
        for rank, beat in beats.items():
            if self.beats.get(rank) != beat:
                self.beats[rank], self.changed[rank] = beat, now
            if beat.state == TIMED_OUT and self.timed_out_since is None:
                self.timed_out_since = now

    def gone(self, now: float) -> list[int]:
        """The peers whose process ended (this machine) or whose heartbeat stopped, unless
        they said they were done (a rank that finished its run exits before the others)."""
        return [r for r in self.peers if self._state(r) != DONE and (
            (r not in self.changed and now - self.started > self.startup_s)
            or (r in self.changed and now - self.changed[r] > self.silence_s)
            or (r in self.beats and process_gone(self.beats[r], self.machine)))]

    def not_joined(self, now: float, settle_s: float) -> list[int]:
        """Once a rank's collective timed out `settle_s` ago: the live ranks still running
        whose collectives did not fail. They never joined the one that timed out."""
        if self.timed_out_since is None or now - self.timed_out_since < settle_s:
            return []
        gone = set(self.gone(now))
        return [r for r in self.ranks if r not in gone and self._state(r) == RUNNING]

    def _state(self, rank: int) -> str | None:
        beat = self.beats.get(rank)
        return beat.state if beat is not None else None

    def step(self, rank: int) -> int | None:
        beat = self.beats.get(rank)
        return beat.step if beat is not None else None


def collective_failure(error: BaseException) -> str | None:
    """'lost' for a collective that failed because a peer's connection ended, 'timeout' for
    one that timed out, None for any other error (a data loader's own timeout included)."""
    text = str(error).lower()
    if not isinstance(error, dist.DistError) and not (
            isinstance(error, RuntimeError) and any(words in text for words in _BACKEND_WORDS)):
        return None
    if any(words in text for words in _LOST_WORDS):
        return "lost"
    if any(words in text for words in _TIMEOUT_WORDS):
        return "timeout"
    return None


def rank_list(ranks: Iterable[int]) -> str:
    """'rank 3', 'ranks 0-2, 5': contiguous ranks as ranges."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start = previous = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(spans)


def steps_of(ranks: Iterable[int], steps: dict[int, int | None]) -> str:
    """'step 12', or 'steps 12 (ranks 0-2), 11 (rank 3)' newest first; 'no step yet' for a
    rank that had finished none."""
    by_step: dict[int, list[int]] = {}
    for rank in ranks:
        step = steps.get(rank)
        by_step.setdefault(-1 if step is None else step, []).append(rank)
    if len(by_step) == 1:
        step = next(iter(by_step))
        return "no step yet" if step < 0 else f"step {step}"
    return "steps " + ", ".join(f"{'none yet' if step < 0 else step} ({rank_list(group)})"
                                for step, group in sorted(by_step.items(), reverse=True))


def silent_line(gone: list[int], stalled: list[int], steps: dict[int, int | None]) -> str:
    """The one line that names the silent ranks, the last step of every rank, and the causes.

    `steps`: every rank's last step as this rank knows it (a peer's as of its last heartbeat).
    """
    parts = []
    if gone:
        parts.append(f"{rank_list(gone)} went silent (last heard at {steps_of(gone, steps)}): "
                     f"{'its process' if len(gone) == 1 else 'their processes'} ended or stopped without an "
                     "error of its own (killed, e.g. by the OOM killer or kill -9, or its node was lost)")
    if stalled:
        parts.append(f"{rank_list(stalled)} made no progress since {steps_of(stalled, steps)}: alive, but never "
                     "joined the collective that timed out (--dist-timeout) on the others (a hang in its own "
                     "code or I/O: data loading, a file system, a deadlock)")
    others = [rank for rank in steps if rank not in gone and rank not in stalled]
    if others:
        parts.append(f"the other ranks reached {steps_of(others, steps)}")
    return "ddp_amp: " + "; ".join(parts)
