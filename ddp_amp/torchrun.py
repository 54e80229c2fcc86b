"""`python -m ddp_amp.torchrun [torchrun options] -m ddp_amp.train ...`: torchrun, quiet on a planned stop.

torchrun's agent forwards the signals named in `--signals-to-handle` to its workers, waits
for them (`--shutdown-timeout`), and then raises `SignalException`, so every preemption of
a multi-node job printed a launcher traceback per node and ended the agent with an error.
The workers have already checkpointed and said so in one line by then; this entry point
runs torchrun unchanged and turns that exception into a silent exit with 128 + the signal,
the code a process stopped by that signal would have. Every other outcome is torchrun's.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except SignalException as stop:
        return 128 + int(signal.Signals(stop.sigval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
