"""The heartbeat helper: a small process per rank that beats for it in the group's store.

A rank's own threads cannot be relied on to beat: a C call that holds the GIL for 15 s
(`torch.load` of a large file, a big `sorted`) pauses every Python thread of the process,
and its peers would take a live rank for a dead one. So each rank starts this helper
(plain Python, no torch: it starts in well under a second, unless its interpreter is slow
to load; the rank stands in for it meanwhile, heart.py). Its loop wakes at least every poll
and
1. looks at its parent's /proc state: gone or a zombie, its last beat says so (GONE: the
   judges name the rank at once, wherever it ran) and it exits; stopped (SIGSTOP), it
   beats no more (a stopped rank is a silent one); running or blocked, it beats, whatever
   the parent's threads are doing;
2. marks the page it shares with the rank with the time (the rank's keeper sees a helper
   that stopped looping) and, every beat period, writes the beat: one `set` with the
   rank's last finished step (read from that page: the training loop writes it there, no
   thread of the rank needs to run) and the state the rank last told it (a line on its
   stdin, written by the rank's watch thread); a new state goes out at once. Each beat
   sent is marked on the page too: the keeper stands in for a helper that loops but whose
   beats do not land (it cannot connect: a store host out of descriptors). A connection
   that failed is tried again after a delay that doubles from a poll up to RECONNECT_BEATS
   beat periods, each drawn between half and all of it: hundreds of helpers that cannot
   connect would otherwise try every poll, together. Its stdin
   closing without a last "end" line means the rank's process is exiting: GONE, as above;
3. holds a WAIT for the job's next news (store_keys.py): a failure published, or the
   store's host done. It reads the verdict when woken and passes it to the rank on its
   stdout: `F <rank that failed>`, `H` (the host finished: its store going away is no
   failure), `L` (the store refuses connections: its host is gone). Its stdout does not
   block: a rank hung with the GIL held reads none of it, and a write into its full pipe
   would stand between the helper and the SIGKILL below; each line is a few bytes, under
   the pipe's atomic size, so it goes whole or not at all.
A rank that a judge named is ended by its own helper at once (SIGKILL), after writing
torchrun's error file with the judge's line and when the evidence began: torchrun then
reports the named rank as the root cause, not the judge that ended first. A rank that
should have ended on other news and is still there after KILL_GRACE_S (hung with the GIL
held, or in code that runs no watch yet) is ended too: every rank ends.
Per rank, one request per beat period; the news costs nothing until there is some.

Run as a script by its path (`python -E -s heartbeat.py ...`): importing the package would
import torch. `heart.Heart` is the rank's side.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import mmap
import os
import select
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any

KILL_GRACE_S = 10.0  # the rank's own watch exits within a poll; longer means it cannot run
STORE_DOWN_POLLS = 3  # consecutive polls the store refused connections: its host is gone
# The page both processes map: the rank's last finished step (int64, written by the rank),
# then the helper's last loop and its last beat sent (monotonic times, written here).
PAGE = struct.Struct("<qdd")
TICK_AT, BEAT_AT = 8, 16
RECONNECT_BEATS = 4  # the longest wait between two tries to connect, in beat periods
END = "end"  # the rank's last line: its state before it is final


def _parent_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def read_step(page: Any) -> str:
    """The rank's last finished step as a beat carries it ("-": none yet)."""
    step = PAGE.unpack_from(page, 0)[0]
    return "-" if step < 0 else str(step)


class Helper:
    """The helper's state and loop (in its own process)."""

    def __init__(self, host: str, port: int, prefix: str, rank: int, beat_s: float, poll_s: float,
                 is_host: bool, parent: int, step_fd: int, generation: int) -> None:
        self.wire = importlib.import_module("store_wire")  # beside this file: no package, no torch
        self.keys = importlib.import_module("store_keys")
        self.address, self.prefix, self.rank = (host, port), prefix, rank
        self.beat_s, self.poll_s, self.is_host, self.parent = beat_s, poll_s, is_host, parent
        self.page = mmap.mmap(step_fd, PAGE.size)
        self.generation, self.count = generation, 0
        self.client: Any = None
        self.state, self.sent_state, self.pending = self.keys.RUNNING, "", b""
        self.eof = self.ending = False
        self.next_beat, self.down = 0.0, 0
        self.failed_connects, self.next_connect = 0, 0.0
        self.failure, self.host_done, self.told_host_done = b"", False, False
        self.failure_at: float | None = None
        self.record: dict[str, Any] = {}
        self.lost_at: float | None = None

    def run(self) -> None:
        # A launcher's SIGTERM to the worker's process group (torchrun's teardown) is the
        # rank's to handle: this process ends with it, after its last word.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.set_blocking(1, False)  # the rank may never read: news must not block the loop
        while True:
            now = time.monotonic()
            struct.pack_into("<d", self.page, TICK_AT, now)
            self._read_state()
            if self.ending:
                self._finish()
                return
            parent = _parent_state(self.parent)
            # Its end of the pipe closed without "end" (its process is exiting), or it is gone.
            if self.eof or os.getppid() != self.parent or parent in (None, "Z", "X"):
                if self.state != self.keys.DONE and not self.failure:  # ended without a word: named at once
                    if self.client is None:
                        self._connect()
                    self._beat(self.keys.GONE)
                return
            if self.client is None and now >= self.next_connect:
                self._connect()
            if parent not in ("T", "t") and (now >= self.next_beat or self.state != self.sent_state):
                self._beat(self.state)
                self.next_beat = now + self.beat_s
            if self._act(now):
                return
            self._wait(min(self.poll_s, max(0.0, self.next_beat - time.monotonic())))

    def _read_state(self) -> None:
        """The rank's lines: a state, or "end" after its last state (heart.py's `stop`)."""
        if not select.select([0], [], [], 0)[0]:
            return
        data = os.read(0, 4096)
        self.eof = not data
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            word = line.decode().strip()
            if word == END:
                self.ending = True
            elif word:
                self.state = word

    def _connect(self) -> None:
        try:
            self.client = self.wire.WireClient(*self.address, self.prefix)
            self._hear()
            self.down = self.failed_connects = 0
            return
        except ConnectionRefusedError:
            self.down += 1
        except OSError:
            pass
        if self.client is not None:
            with contextlib.suppress(OSError):
                self.client.close()
        self.client = None
        self.failed_connects += 1
        self.next_connect = time.monotonic() + self.wire.reconnect_delay(
            self.failed_connects, self.poll_s, RECONNECT_BEATS * self.beat_s)

    def _hear(self) -> None:
        """Read the verdict and wait for the next news (a WAIT the store answers later)."""
        failure, done, news = self.client.multi_get([self.keys.FAILURE_KEY, self.keys.HOST_DONE_KEY,
                                                     self.keys.NEWS_KEY])
        self.failure = self.failure or failure
        self.host_done = self.host_done or bool(done)
        self.client.send(self.client.wait_request(self.keys.news_slot(int(news or 0) + 1)))

    def _beat(self, state: str) -> None:
        if self.client is None:
            return
        self.count += 1
        value = self.keys.beat(f"{self.generation}:{self.count}", read_step(self.page), state)
        try:
            self.client.set(f"{self.keys.BEAT_KEY}{self.rank}", value)
            self.sent_state = state
            struct.pack_into("<d", self.page, BEAT_AT, time.monotonic())
        except OSError:
            self._lost()

    def _lost(self) -> None:
        with contextlib.suppress(OSError):
            self.client.close()
        self.client = None

    def _wait(self, timeout: float) -> None:
        """Until stdin speaks, the store answers the WAIT (or closes), or `timeout` passes."""
        sources = [0] if self.client is None else [0, self.client.sock]
        readable = select.select(sources, [], [], timeout)[0]
        if self.client is None or self.client.sock not in readable:
            return
        try:
            if self.client.woken():
                self._hear()
                return
        except OSError:
            pass
        self._lost()  # reconnected at the next loop; refused connections count as down

    def _finish(self) -> None:
        """The rank said "end" after its last state: beat it, and where this rank hosts the
        store and is done, say so (a connection of its own: this one holds a WAIT)."""
        self._beat(self.state)
        if self.is_host and self.state == self.keys.DONE:
            with contextlib.suppress(OSError):
                client = self.wire.WireClient(*self.address, self.prefix)
                client.set(self.keys.HOST_DONE_KEY, b"1")
                self.keys.announce(client)
                client.close()

    def _act(self, now: float) -> bool:
        """Pass news to the rank; end the rank where it is named or cannot end itself. True
        once this helper's work is over."""
        if self.failure and self.failure_at is None:
            self.failure_at = now
            self.record = self.keys.parse_failure(self.failure)
            if self.rank in self.record.get("named", []):
                _leave_error_file(self.record)
                os.kill(self.parent, signal.SIGKILL)
                return True
            _tell(b"F %d" % _int(self.record.get("rank")))
        if self.host_done and not self.told_host_done:
            self.told_host_done = True
            _tell(b"H")
        if self.down >= STORE_DOWN_POLLS and self.lost_at is None:
            self.lost_at = now
            _tell(b"L")
        theirs = self.failure_at is not None and self.record.get("rank") != self.rank
        stranded = self.lost_at is not None and not self.host_done
        since = self.failure_at if theirs else self.lost_at if stranded else None
        if since is not None and now - since > KILL_GRACE_S:
            os.kill(self.parent, signal.SIGKILL)
            return True
        return False


def _leave_error_file(record: dict[str, Any]) -> None:
    """Under torchrun: the named rank's error file, unless it wrote one itself. torchrun
    reports the failure with the earliest time as the root cause: this one's is when the
    evidence against the rank began, before any other rank ended."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    since = record.get("since")
    when = int(since) if isinstance(since, (int, float)) else int(time.time())
    message = str(record.get("message", ""))
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": message, "timestamp": str(when)}}}))


def _int(value: Any) -> int:
    return value if isinstance(value, int) else -1


def _tell(news: bytes) -> None:
    with contextlib.suppress(OSError):  # the rank is gone, or stopped reading and its pipe is full
        os.write(1, news + b"\n")


if __name__ == "__main__":
    _host, _port, _prefix, _rank, _beat_s, _poll_s, _is_host, _parent, _fd, _generation = sys.argv[1:]
    Helper(_host, int(_port), _prefix, int(_rank), float(_beat_s), float(_poll_s), _is_host == "1", int(_parent),
           int(_fd), int(_generation)).run()
