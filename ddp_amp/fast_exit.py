"""End a command's process without the interpreter's last sweep over torch's objects.

At exit CPython runs its cycle collector over every object still alive. Once torch and
torch._dynamo are imported (every training process: the optimizer imports dynamo) that
sweep alone takes about 0.9 s of CPU, after the run has finished and said so
(docs/facts.md, "Interpreter exit sweeps torch's heap"): on every rank of every launch,
restart and test. `gc.freeze()` first moves every live object into the permanent
generation the collector skips. atexit handlers still run (trackers flush there), modules
are still torn down, and the memory goes back with the process as it would anyway. What
no longer runs is the finalizer of an object kept alive by a reference cycle alone; the
commands close their files, trackers and process group themselves before they return.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """`sys.exit(code)`, skipping the collector's sweep of the heap at interpreter exit."""
    gc.freeze()
    sys.exit(code)
