"""A heartbeat helper whose rank never reads its news: a real helper process against a real
TCPStore. A rank hung with the GIL held reads nothing of its helper; the failure its helper
passes on must not fill the pipe and block the helper before the SIGKILL that ends that rank.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ddp_amp.distributed.failure import claim_failure
from ddp_amp.distributed.heartbeat import KILL_GRACE_S
from ddp_amp.distributed.store_keys import BEAT_KEY
from ddp_amp.distributed.store_wire import WireClient
from tests.multiproc import REPO_ROOT, cli_env

PREFIX = "ddp_amp/attempt_0"


def _beat_tag(reader: WireClient, rank: int) -> str:
    return reader.multi_get([f"{BEAT_KEY}{rank}"])[0].decode().split(" ")[0]


def _until(condition: object, what: str, timeout: float = 30.0) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, f"never: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


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
