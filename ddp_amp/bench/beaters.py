"""Emulated ranks for the scale benchmark: each with its own connection to the store, sending
what that rank's heartbeat helper sends, at its rate.

    python -E -s beaters.py HOST PORT PREFIX FIRST END BEAT_S

Ranks FIRST..END-1, one connection each. On each, first what a helper does as it connects
(the handshake, one read of the verdict, a WAIT for news), then one `set` of the rank's beat
every BEAT_S seconds, each rank at its own phase (rank i of n at i/n of the period). Prints
"ready" once connected, then answers each line on stdin: "count" with how many beats it has
sent so far, "stop R" by stopping rank R's beats (its connection stays, as a lost node's
does); EOF ends it. One process holds thousands of connections: the machine that runs the
benchmark cannot run a helper process per rank, but each connection carries one rank's load.
Run by its path, standard library only (store_wire.py and store_keys.py are loaded by path).
"""

from __future__ import annotations

import importlib.util
import os
import select
import sys
import time
from pathlib import Path
from types import ModuleType

_DISTRIBUTED = Path(__file__).resolve().parent.parent / "distributed"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _DISTRIBUTED / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"{name}.py not found beside {_DISTRIBUTED}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(host: str, port: int, prefix: str, first: int, end: int, beat_s: float) -> None:
    wire, keys = _load("store_wire"), _load("store_keys")
    ranks = list(range(first, end))
    clients = []
    for _ in ranks:  # as each rank's helper connects
        client = wire.WireClient(host, port, prefix, timeout_s=120)
        news = client.multi_get([keys.FAILURE_KEY, keys.HOST_DONE_KEY, keys.NEWS_KEY])[2]
        client.send(client.wait_request(keys.news_slot(int(news or 0) + 1)))
        clients.append(client)
    print("ready", flush=True)
    stopped: set[int] = set()
    sent, cycle, index = 0, 0, 0
    start = time.monotonic()
    pending = b""
    while True:
        due = start + (cycle + index / len(ranks)) * beat_s
        wait = due - time.monotonic()
        if wait > 0 and select.select([0], [], [], wait)[0]:
            data = os.read(0, 4096)
            if not data:
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                words = line.decode().split()
                if words[:1] == ["count"]:
                    print(sent, flush=True)
                elif words[:1] == ["stop"]:
                    stopped.add(int(words[1]))
            continue
        rank = ranks[index]
        if rank not in stopped:
            clients[index].set(f"{keys.BEAT_KEY}{rank}", keys.beat(str(cycle + 1), "-", keys.RUNNING))
            sent += 1
        index += 1
        if index == len(ranks):
            cycle, index = cycle + 1, 0


if __name__ == "__main__":
    _host, _port, _prefix, _first, _end, _beat_s = sys.argv[1:]
    main(_host, int(_port), _prefix, int(_first), int(_end), float(_beat_s))
