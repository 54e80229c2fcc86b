"""The rank's side of its heartbeat helper (heartbeat.py): start it, tell it the state, read
its news, and keep the rank's beats going when the helper does not beat.

A helper can fail its rank without ending: its interpreter slow to start (a shared file
system under load), the process stopped (SIGSTOP), stuck in the kernel (D state) or
starved, or looping but unable to connect (a store host out of descriptors refuses some
connections and not others). Its beats would stop while the rank is well, and a judge would
name a live rank on evidence about the helper. So a keeper thread of the rank looks every
poll at the page they share: when the helper last sent a beat, and when it last went round
its loop:
- no beat sent for a beat period and two polls (whether or not the helper loops), the
  keeper beats in its place, at the beat period, from a connection of its own: the rank's
  own thread runs, which is evidence about the rank (a rank whose threads cannot run, with
  a helper that cannot beat, is named); once the helper's beats are sent again, the keeper
  closes that connection (each is a descriptor of the store's host), and where it cannot
  connect either, it tries again after a growing delay (store_wire.reconnect_delay);
- a helper that looped and then stopped for RESTART_AFTER_BEATS beat periods is ended and a
  new one started (one that has not looped yet is left to start: a new one would start as
  slowly), and so is a helper that ended (the OOM killer).
The step goes through `page`, which the rank's `Progress` writes to (`Progress.mirror_to`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ddp_amp.distributed.heartbeat import END, PAGE, RECONNECT_BEATS, read_step
from ddp_amp.distributed.store_keys import BEAT_KEY, RUNNING, beat
from ddp_amp.distributed.store_wire import WireClient, reconnect_delay

HELPER = Path(__file__).with_name("heartbeat.py")
RESTART_AFTER_BEATS = 4  # beat periods (plus polls) a helper that looped before may stay quiet


def _shared_page() -> tuple[int, mmap.mmap]:
    """A file of PAGE.size bytes with no name (nothing to clean up after a SIGKILL), mapped
    here; its descriptor is passed to the helper, which maps it too."""
    try:
        fd = os.memfd_create("ddp_amp-heart")
    except (AttributeError, OSError):  # no memfd: an unlinked temporary file is as good
        with tempfile.TemporaryFile() as handle:
            fd = os.dup(handle.fileno())
    os.ftruncate(fd, PAGE.size)
    page = mmap.mmap(fd, PAGE.size)
    PAGE.pack_into(page, 0, -1, 0.0, 0.0)
    return fd, page


class Heart:
    """This rank's helper, its keeper thread, and the page the two share."""

    def __init__(self, route: tuple[str, int, str], rank: int, beat_s: float, poll_s: float, is_host: bool) -> None:
        self._fd, self._map = _shared_page()
        self.page = memoryview(self._map)
        self.route, self.rank, self.beat_s, self.poll_s, self.is_host = route, rank, beat_s, poll_s, is_host
        self._state = RUNNING
        self._generation = 0
        self._spawned_at = 0.0
        self._pending = b""
        self._lock = threading.Lock()  # the current helper and its unread output
        self._stopping = threading.Event()
        self._stand_in: WireClient | None = None
        self._stood_in = 0
        self._failed_stand_ins = 0
        self._next_stand_in = 0.0
        self.proc = self._spawn()
        self._keeper = threading.Thread(target=self._keep, name="ddp_amp-heart-keeper", daemon=True)
        self._keeper.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._generation += 1
        self._spawned_at = time.monotonic()
        host, port, prefix = self.route
        proc = subprocess.Popen(
            [sys.executable, "-E", "-s", str(HELPER), host, str(port), prefix, str(self.rank), str(self.beat_s),
             str(self.poll_s), str(int(self.is_host)), str(os.getpid()), str(self._fd), str(self._generation)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
            pass_fds=(self._fd,))
        if proc.stdout is not None:
            os.set_blocking(proc.stdout.fileno(), False)
        self._pending = b""
        self._write(proc, self._state)
        return proc

    # -- the watch thread's side ----------------------------------------------------------

    def tell(self, state: str) -> None:
        self._state = state
        self._write(self.proc, state)

    @staticmethod
    def _write(proc: subprocess.Popen[bytes], state: str) -> None:
        try:
            proc.stdin.write(f"{state}\n".encode())  # type: ignore[union-attr]  # a pipe
            proc.stdin.flush()  # type: ignore[union-attr]  # a pipe
        except (OSError, ValueError):  # it ended: the keeper starts another
            pass

    def news(self) -> list[str]:
        """The lines the helper wrote since the last call."""
        with self._lock:
            try:
                data = self.proc.stdout.read() or b""  # type: ignore[union-attr]  # a pipe, non-blocking
            except OSError:
                data = b""
            *lines, self._pending = (self._pending + data).split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    # -- the keeper -----------------------------------------------------------------------

    def _keep(self) -> None:
        while not self._stopping.wait(self.poll_s):
            self._look(time.monotonic())

    def quiet_s(self, now: float) -> float:
        """How long the current helper has sent no beat (since its start, where it has sent
        none yet), whether or not it goes round its loop."""
        return now - max(PAGE.unpack_from(self.page, 0)[2], self._spawned_at)

    def _look(self, now: float) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            _, tick, _ = PAGE.unpack_from(self.page, 0)
            looped = tick >= self._spawned_at
            if self.proc.poll() is not None or (looped and now - tick > RESTART_AFTER_BEATS * self.beat_s
                                                + 4 * self.poll_s):
                with contextlib.suppress(OSError):
                    self.proc.kill()  # not waited for: one stuck in the kernel ends when it leaves
                self.proc = self._spawn()
            quiet = self.quiet_s(now)
        if quiet <= self.beat_s + 2 * self.poll_s:
            if self._stand_in is not None:  # the helper's beats are sent again: its descriptor back
                self._stand_in.close()
                self._stand_in = None
        elif now >= self._next_stand_in:
            self._next_stand_in = now + self.beat_s
            if not self._beat_for_helper(self._state):
                self._failed_stand_ins += 1
                self._next_stand_in = now + reconnect_delay(self._failed_stand_ins, self.beat_s,
                                                            RECONNECT_BEATS * self.beat_s)

    def _beat_for_helper(self, state: str) -> bool:
        """One beat in the helper's place; False where the store could not be reached."""
        try:
            if self._stand_in is None:
                self._stand_in = WireClient(*self.route)
            self._stood_in += 1
            self._stand_in.set(f"{BEAT_KEY}{self.rank}", beat(f"k{self._stood_in}", read_step(self.page), state))
        except OSError:  # the store is busy or gone: the helper, or its next start, tells which
            if self._stand_in is not None:
                self._stand_in.close()
            self._stand_in = None
            return False
        self._failed_stand_ins = 0
        return True

    # -- the end --------------------------------------------------------------------------

    def stop(self, state: str | None) -> None:
        """End the helper: with a `state`, after its last beat says it (DONE, GONE); without,
        at once and without a word (a new helper takes over)."""
        self._stopping.set()
        if self._keeper is not threading.current_thread():
            self._keeper.join()
        try:
            looped = PAGE.unpack_from(self.page, 0)[1] >= self._spawned_at
            if state is not None and looped and self.proc.poll() is None:
                self.tell(state)
                self._write(self.proc, END)  # its last beat, then it exits
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    self.proc.stdin.close()  # type: ignore[union-attr]  # a pipe
                    self.proc.wait(5 + 2 * self.poll_s)
            if self.proc.returncode != 0:  # not ended after its last beat: ended here
                with contextlib.suppress(OSError):
                    self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
                if state is not None:  # a helper that never ran or hung: the last word is the rank's
                    self._beat_for_helper(state)
        finally:
            if self._stand_in is not None:
                self._stand_in.close()
            self._release()

    def _release(self) -> None:
        """Unmap the page and close its descriptor; a Progress still mirroring to it must have
        been pointed elsewhere first (`Progress.mirror_to(None)`)."""
        with contextlib.suppress(BufferError, ValueError):  # still exported: left to the collector
            self.page.release()
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
