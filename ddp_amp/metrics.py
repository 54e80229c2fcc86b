"""All rank-0 side effects in one place: console lines, config.json, metrics.jsonl, summary.

Rank 0 gets a `RunLog`; every other rank a `QuietRunLog` whose calls do nothing except
`warn`, so the trainer never writes `if rank == 0`. Records are plain dicts of numbers.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import psutil
import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA tensors on a GPU, else peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is the kernel's own high-water mark (KiB on Linux); psutil has no peak
    # figure on Linux, only the current RSS, so take the larger of the two.
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(peak_kib / 1024, psutil.Process().memory_info().rss / 2**20)


def _format(record: dict[str, Any]) -> str:
    parts = []
    for key, value in record.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


class RunLog:
    """Rank 0's writer: prints to `stream` and records into the run directory."""

    def __init__(self, run_dir: Path, stream: TextIO | None = None) -> None:
        self.run_dir = run_dir
        self.stream = stream or sys.stdout
        run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def info(self, message: str) -> None:
        print(f"[ddp_amp] {message}", file=self.stream, flush=True)

    def warn(self, message: str) -> None:
        print(f"[ddp_amp] warning: {message}", file=sys.stderr, flush=True)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        """Write run_dir/name atomically (temporary file, then rename)."""
        target = self.run_dir / name
        scratch = target.with_suffix(target.suffix + ".tmp")
        scratch.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(scratch, target)

    def metrics(self, record: dict[str, Any]) -> None:
        """One logged step: appended to metrics.jsonl and printed as one line."""
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        self.info(_format(record))

    def summary(self, record: dict[str, Any]) -> None:
        self.write_json("summary.json", record)
        self._metrics.write(json.dumps({"summary": record}) + "\n")
        self._metrics.flush()
        self.info("summary: " + _format(record))

    def close(self) -> None:
        self._metrics.close()


class QuietRunLog(RunLog):
    """What ranks other than 0 get: silent, except for warnings tagged with the rank."""

    def __init__(self, rank: int) -> None:  # noqa: D107 - no files, no stream
        self.rank = rank

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        print(f"[ddp_amp rank {self.rank}] warning: {message}", file=sys.stderr, flush=True)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        pass

    def metrics(self, record: dict[str, Any]) -> None:
        pass

    def summary(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def make_run_log(rank: int, run_dir: Path) -> RunLog:
    return RunLog(run_dir) if rank == 0 else QuietRunLog(rank)
