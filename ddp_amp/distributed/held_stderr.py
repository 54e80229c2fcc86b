"""c10d's warnings at a failed rendezvous, held back: ddp_amp's one line says what happened.

When a rank never arrives, every rank that did sees a store call fail (a timeout, or the
store's host gone once it gave up), and torch's C++ code prints a warning with a stack trace
of some 20 frames to the process's stderr before the Python error is raised: up to N-1
traces for one missing rank, around the one line that names the cause. So while a rank
joins its group, file descriptor 2 goes to a file with no name; once the rendezvous is
over, what was written there is printed, less c10d's warnings and their traces where the
rendezvous failed (`drop_c10d`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from types import TracebackType

_TRACE_LINES = (b"frame #", b"Exception raised from", b"<omitting python frames>")


def without_c10d(text: bytes) -> bytes:
    """`text` less c10d's warning lines ("[W... TCPStore.cpp:138] [c10d] ...") and the stack
    traces that follow them."""
    kept: list[bytes] = []
    in_trace = False
    for line in text.splitlines(keepends=True):
        if b"[c10d]" in line:
            in_trace = True
            continue
        if in_trace and (line.startswith(_TRACE_LINES) or not line.strip()):
            continue
        in_trace = False
        kept.append(line)
    return b"".join(kept)


class HeldStderr:
    """A `with` block during which the process's stderr is held, then printed."""

    def __init__(self) -> None:
        self.drop = False

    def drop_c10d(self) -> None:
        """The rendezvous failed: its one line replaces c10d's warnings."""
        self.drop = True

    def __enter__(self) -> HeldStderr:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        text = self._file.read()
        self._file.close()
        if self.drop:
            text = without_c10d(text)
        view = memoryview(text)
        with contextlib.suppress(OSError):
            while view:
                view = view[os.write(2, view):]
