"""The heartbeat helper and the rank's keeper when the store fails some connections, and a
helper whose rank never reads its news: real helper processes against a real TCPStore.

- A store host out of descriptors fails some connections and not others: a helper that
  loops but cannot connect sends no beat, so the keeper beats in its place (its own
  connection goes through), the helper tries again after a growing delay instead of every
  poll, and once its beats are sent again the keeper gives its connection back.
- A rank hung with the GIL held reads nothing of its helper; the failure its helper passes
  on must not fill the pipe and block the helper before the SIGKILL that ends that rank.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ddp_amp.distributed.failure import claim_failure
from ddp_amp.distributed.heart import Heart
from ddp_amp.distributed.heartbeat import KILL_GRACE_S
from ddp_amp.distributed.store_keys import BEAT_KEY, DONE
from ddp_amp.distributed.store_wire import WireClient
from tests.multiproc import REPO_ROOT, cli_env

PREFIX = "ddp_amp/attempt_0"
_HANDSHAKE = 1 + 4 + 1 + 8  # VALIDATE and its magic, then a CHECK of one key: its length, then the key
_MULTI_GET = 10


class HelperCuttingRelay:
    """A TCP relay in front of a real TCPStore. Once `cut()` is called, it closes every
    connection whose first request after the handshake is a read of several keys (a
    heartbeat helper's first: the verdict) and lets the others through (the keeper's first
    is a `set` of the beat), until `mend()`; it counts the helpers' tries meanwhile."""

    def __init__(self, store_port: int) -> None:
        self.store_port = store_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cutting = False
        self.helper_tries = 0
        self.open_others = 0  # connections let through that are not a helper's, still open
        self._helpers: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.cutting, self.helper_tries = True, 0
            for conn in self._helpers:
                conn.shutdown(socket.SHUT_RDWR)

    def mend(self) -> None:
        self.cutting = False

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(("127.0.0.1", self.store_port))
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        for conn in (source, sink):
            conn.close()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        """Client to store: the handshake (its client waits for the answer before it sends
        more), then the first request decides what this connection is."""
        helper = False
        try:
            head = _read(client, _HANDSHAKE + 8)
            upstream.sendall(head + _read(client, struct.unpack_from("<Q", head, _HANDSHAKE)[0]))
            first = client.recv(1 << 16)
            if not first:
                raise OSError
            with self._lock:
                helper = first[0] == _MULTI_GET
                if helper and self.cutting:
                    self.helper_tries += 1
                    raise OSError
                if helper:
                    self._helpers.append(client)
                else:
                    self.open_others += 1
            upstream.sendall(first)
        except OSError:
            client.close()
            upstream.close()
            return
        self._pump(client, upstream)
        if not helper:
            with self._lock:
                self.open_others -= 1


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def _beat_tag(reader: WireClient, rank: int) -> str:
    return reader.multi_get([f"{BEAT_KEY}{rank}"])[0].decode().split(" ")[0]


def _until(condition: object, what: str, timeout: float = 30.0) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, f"never: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_the_keeper_beats_for_a_helper_that_loops_but_cannot_connect_and_the_helper_backs_off() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    relay = HelperCuttingRelay(server.port)
    reader = WireClient("127.0.0.1", server.port, PREFIX)
    heart = Heart(("127.0.0.1", relay.port, PREFIX), rank=1, beat_s=0.5, poll_s=0.25, is_host=False)
    try:
        _until(lambda: ":" in _beat_tag(reader, 1), "the helper's first beat")
        relay.cut()
        stood_in_after = _until(lambda: _beat_tag(reader, 1).startswith("k"), "the keeper standing in")
        time.sleep(4.0)
        tries = relay.helper_tries
        assert heart.proc.poll() is None  # the helper loops on: not ended, only unable to connect
        # Every poll (0.25 s) would be 16 or more tries in those 4 s; doubling from a poll to
        # 4 beat periods (2 s), each wait drawn between half and all of it, at most 9.
        assert 2 <= tries <= 9, tries
        relay.mend()
        _until(lambda: ":" in _beat_tag(reader, 1), "the helper's beats again")
        _until(lambda: relay.open_others == 0, "the keeper's connection given back")
    finally:
        heart.stop(DONE)
        reader.close()
    print(f"keeper stood in {stood_in_after:.2f} s after the helper's connections were cut; "
          f"{tries} tries of the helper in the next 4 s")


def test_a_rank_hung_with_the_gil_held_is_ended_by_its_helper_after_a_long_failure() -> None:
    """Another rank's failure carries a 200 KB message (an exception's text can be that
    long); the rank holds the GIL and reads nothing. Its helper must still end it."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store = dist.PrefixStore(PREFIX, server)
    rank = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests/scripts/rank_holding_the_gil.py"),
                             str(server.port), "1", "2"], stdout=subprocess.PIPE, text=True, env=cli_env(),
                            cwd=REPO_ROOT)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ready\n"
        reader = WireClient("127.0.0.1", server.port, PREFIX)
        _until(lambda: ":" in _beat_tag(reader, 1), "the helper's first beat")
        reader.close()
        assert claim_failure(store, 0, "rank 0: RuntimeError: " + "x" * 200_000)
        started = time.monotonic()
        code = rank.wait(KILL_GRACE_S + 50)
    finally:
        rank.kill()
    assert code == -signal.SIGKILL, code
    print(f"ended {time.monotonic() - started:.1f} s after the failure (grace {KILL_GRACE_S} s)")
