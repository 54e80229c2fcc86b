"""Preemption signals held from the first moments of a process, before its loop can act on them.

A SLURM warning (`--signal=USR1@N`) may come up to a minute before its time, so with a short
time limit it can land while the process still imports torch (seconds) or builds its model;
USR1's and TERM's default action would end the process instead of letting it checkpoint.
`EarlySignals` only flags what came; `guards.PreemptionWatch` takes the flag over when the
loop starts. The CLI makes one holder before its heavy imports, and one for the configured
signals once its options are read, which takes over the first. Standard library only, so
importing it costs nothing.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any


class EarlySignals:
    """Flags `signums` from now on; hands back, restores or ignores them later."""

    def __init__(self, signums: tuple[signal.Signals, ...]) -> None:
        self.signums = signums
        self.received: signal.Signals | None = None
        self.received_at = 0.0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in signums:
                previous = signal.signal(signum, self.on_signal)
                earlier = getattr(previous, "__self__", None)
                if isinstance(earlier, EarlySignals):  # a holder from before: take over its flag
                    if earlier.received is not None and self.received is None:
                        self.received, self.received_at = earlier.received, earlier.received_at
                    previous = earlier._previous.pop(signum, signal.SIG_DFL)
                self._previous[signum] = previous

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), time.monotonic()

    def restore(self) -> None:
        """Give the signals back to the handlers they had before (a caller that goes on)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def ignore_from_now(self) -> None:
        """For a process about to exit, its run finished or stopped: Python's shutdown resets
        its own handlers to the default action, so a warning landing then (SLURM repeats them)
        would kill the process and turn its exit code into a signal; ignored, it cannot."""
        if self._previous:
            for signum in self.signums:
                signal.signal(signum, signal.SIG_IGN)
            self._previous.clear()
