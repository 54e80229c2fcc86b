"""The best checkpoint by an eval metric: a pointer file beside the `step-N` directories.

`checkpoints/best.json` names the step directory that holds the best value so far of one
metric, with the value and the direction (`min` or `max`). Retention never deletes the
directory it names. The pointer is written atomically after that checkpoint is committed:
a crash between the two leaves the previous pointer, whose directory retention also kept.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ddp_amp.checkpoint.discovery import step_dir_name
from ddp_amp.durable import write_atomic

BEST_FILE = "best.json"


@dataclass(frozen=True)
class BestRecord:
    """Which checkpoint holds the best value of `metric` so far."""

    metric: str
    mode: str  # "min" or "max"
    value: float
    step: int

    def beaten_by(self, value: float) -> bool:
        """Is `value` strictly better than this record's (NaN never is)?"""
        if math.isnan(value):
            return False
        return value < self.value if self.mode == "min" else value > self.value

    def directory(self, root: Path) -> Path:
        return root / step_dir_name(self.step)


def read_best(root: Path) -> BestRecord | None:
    """The pointer under checkpoint root `root`, or None if there is none (or it is unreadable)."""
    try:
        fields = json.loads((root / BEST_FILE).read_text())
        return BestRecord(str(fields["metric"]), str(fields["mode"]), float(fields["value"]), int(fields["step"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_best(root: Path, record: BestRecord) -> None:
    """Point at `record`'s checkpoint (atomic: the old pointer or the new one, never half)."""
    write_atomic(root / BEST_FILE, json.dumps(asdict(record), indent=2) + "\n")


def protected_directory(root: Path) -> Path | None:
    """The step directory retention must keep, if a best checkpoint is recorded."""
    record = read_best(root)
    return record.directory(root) if record is not None else None
