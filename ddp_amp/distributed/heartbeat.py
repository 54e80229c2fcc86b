"""The heartbeat helper: a small process per rank that beats for it in the group's store.

A rank's own threads cannot be relied on to beat: a C call that holds the GIL for 15 s
(`torch.load` of a large file, a big `sorted`) pauses every Python thread of the process,
and its peers would take a live rank for a dead one. So each rank starts this helper
(plain Python, no torch: it starts in milliseconds), which every poll
1. looks at its parent's /proc state: gone or a zombie, it exits (the beats stop, the rank
   is named); stopped (SIGSTOP), it skips the beat (a stopped rank is a silent one); running
   or blocked, it beats, whatever the parent's threads are doing;
2. writes the beat (one `set` of O(1) size) with the rank's last finished step, read from a
   page both processes map (the training loop writes it as it sets `Progress.step`: no
   thread of the rank needs to run), and the state the rank last told it (a line on its
   stdin, written by the rank's watch thread);
3. reads the job's verdict (one `multi_get` of two keys: the failure, and whether the store's
   host finished) and passes news to the rank on its stdout: `F <failure>`, `H` (the host
   finished: its store going away is no failure), `L` (the store refuses connections: its
   host is gone).
A rank that should have ended on that news and is still there after KILL_GRACE_S (hung with
the GIL held, or in code that runs no watch yet) is ended by its helper with SIGKILL: every
rank ends, the hung one included. Two requests per rank per poll, whatever the world size.

Run as a script by its path (`python -E -s heartbeat.py ...`): importing the package would
import torch. `Heart` is the rank's side.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FAILURE_KEY = "ddp_amp/failure"  # failure.py's key; this file cannot import it (no torch here)
HOST_DONE_KEY = "ddp_amp/host_done"
BEAT_KEY = "ddp_amp/beat/"
KILL_GRACE_S = 10.0  # the rank's own watch exits within a poll; longer means it cannot run
STORE_DOWN_POLLS = 3  # consecutive polls the store refused connections: its host is gone
STEP_PAGE_BYTES = 8  # the shared page holds one int64: the rank's last finished step


def _parent_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _read_step(page: mmap.mmap) -> str:
    """The rank's last finished step as the beat carries it ("-": none yet); liveness.py's
    `write_step` writes it."""
    step = struct.unpack_from("<q", page, 0)[0]
    return "-" if step < 0 else str(step)


def _helper(host: str, port: int, prefix: str, rank: int, interval_s: float, is_host: bool,
            parent: int, step_fd: int, identity: str) -> None:
    """The helper's loop (in its own process); `identity`: 'pid started machine' of the rank;
    `step_fd`: the page the rank writes its step to."""
    wire = importlib.import_module("store_wire")  # beside this file: no package, no torch
    page = mmap.mmap(step_fd, STEP_PAGE_BYTES, prot=mmap.PROT_READ)
    client: Any = None
    count, state, eof, down = 0, "r", False, 0
    failure_at: float | None = None
    lost_at: float | None = None
    host_done = False
    pending = b""
    while True:
        parent_state = _parent_state(parent)
        if os.getppid() != parent or parent_state in (None, "Z", "X"):
            return
        if select.select([0], [], [], 0)[0]:
            data = os.read(0, 4096)
            eof = not data
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                state = line.decode().strip() or state
        try:
            if client is None:
                client = wire.WireClient(host, port, prefix)
                for key in (FAILURE_KEY, HOST_DONE_KEY):  # created empty: later reads never wait
                    client.compare_set(key, b"", b"")
                down = 0
            if parent_state not in ("T", "t"):
                client.set(f"{BEAT_KEY}{rank}", f"{count} {_read_step(page)} {state} {identity}".encode())
                count += 1
            failure, done = client.multi_get([FAILURE_KEY, HOST_DONE_KEY])
            if eof:
                if is_host and state == "d":
                    client.set(HOST_DONE_KEY, b"1")
                return
        except OSError:
            client = None
            try:
                wire.WireClient(host, port, prefix).close()
            except ConnectionRefusedError:
                down += 1
            except OSError:
                pass
            failure, done = b"", b""
            if eof:
                return
        now = time.monotonic()
        if failure and failure_at is None:
            failure_at = now
            _tell(b"F " + failure)
        if done and not host_done:
            host_done = True
            _tell(b"H")
        if down >= STORE_DOWN_POLLS and lost_at is None:
            lost_at = now
            _tell(b"L")
        theirs = bool(failure) and _failed_rank(failure) != rank
        stranded = lost_at is not None and not host_done
        since = failure_at if theirs else lost_at if stranded else None
        if since is not None and now - since > KILL_GRACE_S:
            os.kill(parent, signal.SIGKILL)
            return
        time.sleep(interval_s)


def _failed_rank(failure: bytes) -> int | None:
    try:
        return int(json.loads(failure)["rank"])
    except (ValueError, KeyError, TypeError):
        return None


def _tell(news: bytes) -> None:
    with contextlib.suppress(OSError):  # the rank is gone or stopped reading
        os.write(1, news.replace(b"\n", b" ") + b"\n")


def _shared_page() -> tuple[int, mmap.mmap]:
    """A file of STEP_PAGE_BYTES with no name (nothing to clean up after a SIGKILL), mapped
    here; its descriptor is passed to the helper, which maps it too."""
    try:
        fd = os.memfd_create("ddp_amp-step")
    except (AttributeError, OSError):  # no memfd: an unlinked temporary file is as good
        with tempfile.TemporaryFile() as handle:
            fd = os.dup(handle.fileno())
    os.ftruncate(fd, STEP_PAGE_BYTES)
    page = mmap.mmap(fd, STEP_PAGE_BYTES)
    struct.pack_into("<q", page, 0, -1)
    return fd, page


class Heart:
    """The rank's side of its helper: start it, tell it the state, read its news. The step
    goes through `page`, which the rank's `Progress` writes to (`Progress.mirror_to`)."""

    def __init__(self, address: tuple[str, int], prefix: str, rank: int, interval_s: float, is_host: bool,
                 identity: str) -> None:
        self._fd, self._map = _shared_page()
        self.page = memoryview(self._map)
        self.args = [address[0], str(address[1]), prefix, str(rank), str(interval_s), str(int(is_host)),
                     str(os.getpid()), str(self._fd), identity]
        self.interval_s = interval_s
        self._pending = b""
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-E", "-s", __file__, *self.args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                                pass_fds=(self._fd,))
        if proc.stdout is not None:
            os.set_blocking(proc.stdout.fileno(), False)
        return proc

    def ensure_running(self) -> None:
        """Start it again where it ended (killed by the OOM killer, say): its beats are the rank's."""
        if self.proc.poll() is not None:
            self.proc = self._spawn()

    def tell(self, state: str) -> None:
        try:
            self.proc.stdin.write(f"{state}\n".encode())  # type: ignore[union-attr]  # a pipe
            self.proc.stdin.flush()  # type: ignore[union-attr]  # a pipe
        except (OSError, ValueError):  # it ended: ensure_running starts it again
            pass

    def news(self) -> list[str]:
        """The lines the helper wrote since the last call."""
        try:
            data = self.proc.stdout.read() or b""  # type: ignore[union-attr]  # a pipe, non-blocking
        except OSError:
            data = b""
        *lines, self._pending = (self._pending + data).split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def stop(self, state: str | None) -> None:
        """End the helper: with a `state`, after its last beat says it (DONE); without, at once
        (a failed rank's beats stop: its peers are right to name it once it is gone)."""
        try:
            if state is not None and self.proc.poll() is None:
                self.tell(state)
                try:
                    self.proc.stdin.close()  # type: ignore[union-attr]  # a pipe: EOF makes its last beat
                    self.proc.wait(5 + 2 * self.interval_s)
                    return
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self.proc.kill()
            self.proc.wait()
        finally:
            self._release()

    def _release(self) -> None:
        """Unmap the page and close its descriptor; a Progress still mirroring to it must have
        been pointed elsewhere first (`Progress.mirror_to(None)`)."""
        with contextlib.suppress(BufferError, ValueError):  # still exported: left to the collector
            self.page.release()
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


if __name__ == "__main__":
    _host, _port, _prefix, _rank, _interval, _is_host, _parent, _step_fd, *_identity = sys.argv[1:]
    _helper(_host, int(_port), _prefix, int(_rank), float(_interval), _is_host == "1", int(_parent), int(_step_fd),
            " ".join(_identity))
