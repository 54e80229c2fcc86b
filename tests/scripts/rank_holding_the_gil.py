"""A rank whose every thread stops: its watch runs, then one C call holds the GIL for good.

    python tests/scripts/rank_holding_the_gil.py PORT RANK WORLD_SIZE

Joins the store at 127.0.0.1:PORT (hosted by the test) as RANK of WORLD_SIZE, starts the
failure watch and its heartbeat helper as a Session does, prints "ready" once its first beat
is in the store, and then holds the GIL in libc's `sleep` (through ctypes.PyDLL, which does
not release it), as a rank hung in a long C call does: its watch thread never reads its
helper's news again, and only its helper can end it.
"""

from __future__ import annotations

import ctypes
import sys
from datetime import timedelta

import torch.distributed as dist

from ddp_amp.distributed import PeerWatch, Progress
from ddp_amp.distributed.liveness import remember_prefix
from ddp_amp.distributed.store_keys import BEAT_KEY
from ddp_amp.env import DistEnv

PREFIX = "ddp_amp/attempt_0"

port, rank, world_size = (int(word) for word in sys.argv[1:4])
store = dist.PrefixStore(PREFIX, dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60),
                                               wait_for_workers=False))
remember_prefix(store, PREFIX)
watch = PeerWatch(store, DistEnv(rank=rank, world_size=world_size, master_port=port), Progress()).start()
store.wait([f"{BEAT_KEY}{rank}"])
print("ready", flush=True)
libc = ctypes.PyDLL(None)
while True:
    libc.sleep(3600)
