"""A script whose Session is started and never closed; rank 1 ends first, rank 0 goes on.

    torchrun --nproc_per_node=2 tests/plugins/unclosed_session.py DIR finish|raise

Rank 1 writes its pid to DIR and ends: normally (`finish`) or with an uncaught exception
(`raise`). Rank 0 waits until that process is gone, works on for several of its watch's
polls, and prints "rank 0 finished".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ddp_amp import Session
from tests.multiproc import is_running

POLLS_S = 2.0  # four polls of the failure watch: time enough to see rank 1 gone

folder, how = Path(sys.argv[1]), sys.argv[2]
session = Session(precision="fp32", device="cpu").start()
if session.ctx.rank == 1:
    (folder / "rank1.pid.tmp").write_text(str(os.getpid()))
    (folder / "rank1.pid.tmp").rename(folder / "rank1.pid")  # whole when rank 0 sees it
    if how == "raise":
        raise RuntimeError("rank 1 failed in the script's own code")
else:
    while not (folder / "rank1.pid").exists() or is_running(int((folder / "rank1.pid").read_text())):
        time.sleep(0.05)
    time.sleep(POLLS_S)
    print("rank 0 finished", flush=True)
