"""`python -m ddp_amp.torchrun [torchrun options] -m ddp_amp.train ...`: torchrun, quiet on a planned stop.

torchrun's agent forwards the signals named in `--signals-to-handle` to its workers, waits
for them (`--shutdown-timeout`), and then raises `SignalException`, so every preemption of
a multi-node job printed a launcher traceback per node and ended the agent with an error.
The workers have already checkpointed and said so in one line by then; this entry point
runs torchrun unchanged and turns that exception into a silent exit with 128 + the signal,
the code a process stopped by that signal would have. Every other outcome is torchrun's.

The launchers pass `--signals-to-handle` and `--shutdown-timeout`, which torchrun has only
in newer torch (2.13 has them, 2.7 not). Where it lacks them they are left out, with one
line saying what that means: the agent forwards only its default signals (TERM, INT, HUP,
QUIT: not USR1) and gives the workers its own default time to stop.
"""

from __future__ import annotations

import signal
import sys

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main

from ddp_amp.fast_exit import exit_process
from ddp_amp.torch_api import NEWER_TORCHRUN_OPTIONS, torchrun_knows


def without_unknown_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv` less the newer torchrun options this torchrun lacks (as `--option=value` or
    `--option value`, before the script); and the options left out."""
    unknown = [option for option in NEWER_TORCHRUN_OPTIONS if not torchrun_knows(option)]
    kept: list[str] = []
    dropped: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in ("-m", "--module") or not arg.startswith("-"):  # the script and its own arguments
            kept += argv[index:]
            break
        name = arg.split("=", 1)[0]
        if name in unknown:
            dropped.append(name)
            index += 1 if "=" in arg else 2
            continue
        kept.append(arg)
        index += 1
    return kept, dropped


def main(argv: list[str] | None = None) -> int:
    argv, dropped = without_unknown_options(sys.argv[1:] if argv is None else argv)
    if dropped:
        print(f"ddp_amp.torchrun: torch {torch.__version__}'s torchrun has no {' or '.join(dropped)}: left out "
              "(its agent forwards TERM, INT, HUP and QUIT, not USR1, and waits its default time for the workers; "
              "torch >= 2.13 has both)", file=sys.stderr)
    try:
        torchrun_main(argv)
    except SignalException as stop:
        return 128 + int(signal.Signals(stop.sigval))
    return 0


if __name__ == "__main__":
    exit_process(main())
