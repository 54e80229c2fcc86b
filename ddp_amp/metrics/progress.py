"""Rank 0's progress display, owned by `RunLog`: a tqdm bar on a terminal, nothing extra elsewhere.

On a terminal the bar advances every step (tqdm redraws at most ~10 times a second) and
shows the latest logged loss, loss scale, skipped steps and samples/s; other messages go
above it through `tqdm.write`, so the bar is never torn. When stdout is not a terminal
(SLURM logs, CI, pipes) there is no bar: `RunLog` prints one plain line per logged step.
"""

from __future__ import annotations

import io
import os
from typing import Any, TextIO

from tqdm import tqdm


def _terminal_size(stream: TextIO) -> int:
    """columns x lines of the terminal behind `stream`; 0 where it reports none."""
    try:
        size = os.get_terminal_size(stream.fileno())
        return size.columns * size.lines
    except (OSError, ValueError, io.UnsupportedOperation):
        return 0


class ProgressBar:
    """A tqdm bar over optimizer steps, writing to `stream`."""

    def __init__(self, stream: TextIO, total: int, initial: int = 0) -> None:
        # Follow the terminal's size, except where it reports 0 x 0 (a bare pty, some batch
        # consoles): tqdm would then hide the bar (it draws only rows < the height).
        width: dict[str, Any] = {"dynamic_ncols": True} if _terminal_size(stream) > 0 else {"ncols": 100, "nrows": 24}
        self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=stream,
                         leave=True, mininterval=0.1, **width)

    def advance(self, steps: int = 1) -> None:
        self._bar.update(steps)

    def show(self, record: dict[str, Any]) -> None:
        """Put a logged step's numbers after the bar."""
        shown = {"loss": record.get("loss"), "scale": record.get("loss_scale"),
                 "skipped": record.get("skipped_total"), "samples/s": record.get("samples_per_s")}
        self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v)
                               for k, v in shown.items() if v is not None}, refresh=False)

    def write(self, line: str, stream: TextIO | None = None) -> None:
        """Print `line` above the bar (to `stream`, default the bar's own), then redraw it."""
        self._bar.write(line, file=stream or self._bar.fp)

    def close(self) -> None:
        self._bar.close()
