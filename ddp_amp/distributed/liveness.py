"""Which ranks are alive and making progress: a heartbeat per rank in the group's store.

Each rank's heartbeat (store_keys.py) is written by its heartbeat helper (heartbeat.py), a
process that beats while the rank's process runs, whatever its threads do; the rank's
keeper (heart.py) beats in its place while the helper does not. A beat carries a tag that
changes every time, the last step the training loop finished (`Progress.step`, which the
loop sets once per step: the loop itself never touches the store) and the rank's state.
The beats are read in batches by the judges (ranks 0 and 1), never by every rank: the
store's work per beat period grows with the number of ranks, not with its square.

Each rank beats every `beat_s`: the poll (`--peer-poll`), widened at large world sizes so
that the store receives at most BEATS_PER_S beats a second (at 16,384 ranks, one beat per
rank every 4 s); the silence limit is then at least four beat periods (`silence_for`).

A peer has *gone silent* when
- its last beat says GONE: its helper saw its process end without saying it was done
  (killed, e.g. by the OOM killer): known within a poll, on any machine;
- or its heartbeat has not changed for the silence limit since it was first seen: a
  process killed with its helper, a node lost, a process stopped (SIGSTOP). A rank's clock
  starts at its first beat, written as it joins the group: ranks that reach their loop at
  different times are not silent.
A peer has *stopped making progress* when a rank's collective timed out and the peer is
alive (its heartbeat goes on) but no collective of its own failed: it never joined. A peer
with no beat at all by then *never arrived* (a group whose ranks do not wait for each other
as it forms: NCCL's, formed lazily). A rank that finished its run says so in its last
heartbeat (DONE) before it exits: the ranks still finishing do not take its end for silence.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

from ddp_amp.distributed.store_keys import DONE, GONE, RUNNING, TIMED_OUT
from ddp_amp.errors import UsageError

# A heartbeat unchanged this long means its process is gone. Well above any pause of a
# live process's helper, well under the 30 s a launcher waits between its SIGTERM and its
# SIGKILL.
SILENCE_S = 10.0
POLL_S = 0.5
# The store's budget of beats a second, whatever the world size: measured at about 12 us of
# the store thread per beat on a loaded 2-core machine (docs/benchmarks.md), 4,096 beats a
# second are 5% of a core.
BEATS_PER_S = 4096.0
_PREFIXES: dict[int, str] = {}  # id of a PrefixStore made by group.py -> its prefix
_RUNNING_BYTE = ord(RUNNING)

# Words of a collective that failed because a peer's connection ended, or timed out
# (gloo: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer", "Connection reset
# by peer", "[.../unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation";
# NCCL: "Watchdog caught collective operation timeout").
_BACKEND_WORDS = ("gloo", "nccl")
_LOST_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")
_TIMEOUT_WORDS = ("timed out", "timeout")


@dataclass(frozen=True)
class Liveness:
    """How often each rank beats, how long a peer may be silent, and how many beats a second
    the store receives at most: the defaults are above; `--peer-poll`, `--peer-silence` and
    `--peer-beats-per-s` set them for a run. Above `beats_per_s * poll_s` ranks the beats
    widen (`beat_s`) and so may the silence limit (`silence_for`): `notice` says so."""

    poll_s: float = POLL_S
    silence_s: float = SILENCE_S
    beats_per_s: float = BEATS_PER_S

    def check(self) -> None:
        """One line where the silence limit does not span several polls: a beat or two late
        (a loaded machine) would then name a live rank."""
        if self.silence_s < 4 * self.poll_s:
            raise UsageError("--peer-silence", self.silence_s,
                             f"at least 4 polls ({4 * self.poll_s:g} s at --peer-poll {self.poll_s:g})",
                             "raise --peer-silence or lower --peer-poll")
        if not self.beats_per_s > 0:
            raise UsageError("--peer-beats-per-s", self.beats_per_s, "a number of beats > 0", f"e.g. {BEATS_PER_S:g}")

    def beat_s(self, world_size: int) -> float:
        """Seconds between two beats of a rank in a world of `world_size`: the poll, or longer
        where the world would send the store more than `beats_per_s` beats a second."""
        return max(self.poll_s, world_size / self.beats_per_s)

    def silence_for(self, world_size: int) -> float:
        """The silence limit in a world of `world_size`: at least four beat periods."""
        return max(self.silence_s, 4 * self.beat_s(world_size))

    def detection(self, world_size: int) -> tuple[float, float, float]:
        """How long until a rank is named in a world of `world_size`: at most for one whose
        process ended (its helper's GONE goes out within a poll, a judge reads every beat
        period), and at least and at most for one that went silent (its last beat came up to
        a beat period before it stopped; a judge reads every beat period, and reads again
        before it names)."""
        beat, silence = self.beat_s(world_size), self.silence_for(world_size)
        return self.poll_s + beat, silence - beat, silence + 2 * beat

    def notice(self, world_size: int) -> str | None:
        """One line where `world_size` widens the poll or the silence limit past the ones
        set, with the detection times that follow and the option that trades them for store
        load; None where nothing is widened."""
        beat, silence = self.beat_s(world_size), self.silence_for(world_size)
        widened = []
        if beat > self.poll_s:
            widened.append(f"beats every {beat:g} s (not --peer-poll {self.poll_s:g} s)")
        if silence > self.silence_s:
            widened.append(f"is named silent after {silence:g} s of silence (not --peer-silence {self.silence_s:g} s)")
        if not widened:
            return None
        killed, fastest, slowest = self.detection(world_size)
        return (f"[ddp_amp] at {world_size:,} ranks each rank {' and '.join(widened)}: the store receives at most "
                f"--peer-beats-per-s {self.beats_per_s:,.0f} beats a second; a rank whose process ended is named "
                f"within {killed:g} s, a stopped or lost one in {fastest:g}-{slowest:g} s (raise "
                "--peer-beats-per-s for faster detection at that much more load on the store: docs/watching.md)")


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
    """The step as the helper reads it (heartbeat.py's `read_step`): int64, -1 for none."""
    struct.pack_into("<q", page, 0, -1 if step is None else step)



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
    probe = f"ddp_amp/route-probe/{socket.gethostname()}/{os.getpid()}"
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



class PeerTracker:
    """Every rank's heartbeat as a judge last read it, and since when each has not changed.

    Beats are compared as bytes, never decoded on the way: at 16,384 ranks a judge's poll is
    one comparison per rank (a few ms of CPU); a beat whose state is not RUNNING is noted,
    and steps are read only for the line that names a rank.
    """

    def __init__(self, rank: int, world_size: int, silence_s: float = SILENCE_S) -> None:
        self.rank, self.ranks, self.silence_s = rank, range(world_size), silence_s
        self.beats: list[bytes] = [b""] * world_size
        self.changed: list[float] = [math.inf] * world_size  # inf: no beat yet (its clock starts at its first)
        self.unusual: dict[int, str] = {}  # ranks whose last beat's state is not RUNNING
        self.timed_out_since: float | None = None  # when a rank first said its collective timed out

    def update(self, beats: list[bytes], now: float, ranks: Iterable[int] | None = None) -> None:
        """Note `beats` (of `ranks`, every rank where None) as read at `now`; b"": none yet."""
        known, changed, unusual = self.beats, self.changed, self.unusual
        for rank, value in zip(self.ranks if ranks is None else ranks, beats):
            if value != known[rank] and value:
                known[rank], changed[rank] = value, now
                if value[-1] != _RUNNING_BYTE or rank in unusual:
                    self._note(rank, value[-1:].decode(errors="replace"), now)

    def _note(self, rank: int, state: str, now: float) -> None:
        if state == RUNNING:
            del self.unusual[rank]
            return
        self.unusual[rank] = state
        if state == TIMED_OUT and self.timed_out_since is None:
            self.timed_out_since = now

    def gone(self, now: float) -> list[int]:
        """The peers whose process ended without a word (GONE) or whose heartbeat stopped,
        unless they said they were done (a rank that finished its run exits before the others)."""
        deadline = now - self.silence_s
        quiet = {r for r, at in enumerate(self.changed) if at < deadline and self.unusual.get(r) != DONE}
        quiet.update(r for r, state in self.unusual.items() if state == GONE)
        quiet.discard(self.rank)
        return sorted(quiet)

    def _settled(self, now: float, settle_s: float) -> bool:
        return self.timed_out_since is not None and now - self.timed_out_since >= settle_s

    def not_joined(self, now: float, settle_s: float) -> list[int]:
        """Once a rank's collective timed out `settle_s` ago: the live ranks still running
        whose collectives did not fail. They never joined the one that timed out."""
        if not self._settled(now, settle_s):
            return []
        gone = set(self.gone(now))
        return [r for r in self.ranks if r not in gone and r not in self.unusual and self.changed[r] < math.inf]

    def never_arrived(self, now: float, settle_s: float) -> list[int]:
        """Once a rank's collective timed out `settle_s` ago: the peers that never beat."""
        if not self._settled(now, settle_s):
            return []
        return [r for r in self.ranks if self.changed[r] == math.inf and r != self.rank]

    def step(self, rank: int) -> int | None:
        """The last step `rank`'s last beat carried (None: none yet, or no beat)."""
        parts = self.beats[rank].split(b" ")
        return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None

    def since(self, ranks: list[int], now: float) -> float:
        """When the evidence against `ranks` began (their last change, or the timeout), in
        seconds since the epoch."""
        began = min((self.changed[r] for r in ranks if self.changed[r] < math.inf), default=now)
        if self.timed_out_since is not None:
            began = min(began, self.timed_out_since)
        return time.time() - (now - began)


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
