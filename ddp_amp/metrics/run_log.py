"""All rank-0 side effects in one place: console lines, config.json, metrics.jsonl, summary.

Rank 0 gets a `RunLog`; every other rank a `QuietRunLog` that prints only warnings, so the
trainer never writes `if rank == 0`. Records are plain dicts of numbers. Every write to the
run directory goes through `distributed.on_rank_zero`: rank 0 writes and every rank learns whether
it worked, so a failed write (a full disk, a bad record) stops every rank with its message
instead of leaving the others waiting in their next collective. That makes `metrics`,
`event`, `write_json`, `rewind_to` and `summary` collective: every rank calls them at the
same points, as the trainer does.

Progress: on a terminal rank 0 shows a tqdm bar (progress.py); elsewhere it prints
one plain line per logged step. metrics.jsonl holds one object per logged step, event
records (`{"event": "overflow", "step": ...}`) and `{"summary": ...}` objects; after a
resume from step S, `rewind_to(S)` drops what a lost attempt wrote past S, so the replayed
steps are neither duplicated nor missing.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import psutil
import torch

from ddp_amp.distributed import on_rank_zero
from ddp_amp.durable import write_atomic
from ddp_amp.metrics.progress import ProgressBar
from ddp_amp.metrics.trackers import Trackers, start_trackers


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

    def __init__(self, run_dir: Path, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.run_dir = run_dir
        self.stream = stream or sys.stdout
        # A bar only where someone watches: a terminal. Logs and pipes get plain lines.
        self.use_bar = self.stream.isatty() if bar is None else bar
        self._bar: ProgressBar | None = None
        self._metrics: TextIO | None = None  # opened by the first write, on rank 0
        self._trackers: Trackers | None = None  # --tracker, on rank 0

    def info(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(f"[ddp_amp] {message}")
        else:
            print(f"[ddp_amp] {message}", file=self.stream, flush=True)

    def start_progress(self, total: int, initial: int = 0) -> None:
        """Begin the progress display for steps `initial`..`total` (a bar on a terminal)."""
        if self.use_bar and self._bar is None:
            self._bar = ProgressBar(self.stream, total, initial)

    def advance(self, steps: int = 1) -> None:
        """One more optimizer step done (moves the bar; nothing without one)."""
        if self._bar is not None:
            self._bar.advance(steps)

    def event(self, record: dict[str, Any], message: str) -> None:
        """A notable event (e.g. an overflow report): printed, then appended to metrics.jsonl (collective).

        The line goes out first, so no rank leaves the collective before rank 0 printed it: a
        rank that ends right after (a preemption stop) cannot get rank 0 killed before its line
        is out (srun --kill-on-bad-exit ends the whole step when the first task exits non-zero).
        """
        self.info(message)
        on_rank_zero(lambda: self._append(record))

    def rewind_to(self, step: int) -> int:
        """Drop metrics.jsonl records past `step` (and summaries); returns how many were dropped.

        Call after resuming from a checkpoint at `step` (-1 for a fresh start), before
        logging: the steps after it are replayed and logged again. The file is rewritten
        atomically, so a crash here leaves the old or the new file, never half of one.
        Collective: every rank gets rank 0's count.
        """
        return on_rank_zero(lambda: self._rewind(step))

    def _rewind(self, step: int) -> int:
        path = self.run_dir / "metrics.jsonl"
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        kept, dropped = [], 0
        for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash mid-write
                dropped += 1
                continue
            if "summary" in record or record.get("step", 0) > step:
                dropped += 1
                continue
            kept.append(line + "\n")
        if dropped:
            write_atomic(path, "".join(kept))
        return dropped

    def _append(self, record: dict[str, Any]) -> None:
        if self._metrics is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - open for the run; close() ends it
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def warn(self, message: str) -> None:
        if self._bar is not None:  # stderr on the same terminal would tear the bar
            self._bar.write(f"[ddp_amp] warning: {message}", sys.stderr)
        else:
            print(f"[ddp_amp] warning: {message}", file=sys.stderr, flush=True)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        """Write run_dir/name atomically (temporary file, then rename); collective."""
        on_rank_zero(lambda: self._write_json(name, payload))

    def _write_json(self, name: str, payload: dict[str, Any]) -> None:
        write_atomic(self.run_dir / name, json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")

    def copy_files(self, folder: str, paths: Sequence[str]) -> None:
        """Copy `paths` into run_dir/folder/, each atomically; collective."""
        on_rank_zero(lambda: self._copy_files(folder, paths))

    def _copy_files(self, folder: str, paths: Sequence[str]) -> None:
        (self.run_dir / folder).mkdir(parents=True, exist_ok=True)
        for path in paths:
            write_atomic(self.run_dir / folder / Path(path).name, Path(path).read_bytes())

    def start_trackers(self, specs: list[str], config: dict[str, Any], start_step: int) -> None:
        """Start the `--tracker` trackers on rank 0, continuing this run directory's tracker
        runs when `start_step` > 0 (collective: a tracker that fails to start stops every rank)."""
        if specs:
            on_rank_zero(lambda: self._start_trackers(specs, config, start_step))

    def _start_trackers(self, specs: list[str], config: dict[str, Any], start_step: int) -> None:
        self._trackers = start_trackers(specs, self.run_dir, config, start_step, self.warn)

    def metrics(self, record: dict[str, Any]) -> None:
        """One logged step: appended to metrics.jsonl (collective); on the bar, else a line;
        and to the trackers."""
        on_rank_zero(lambda: self._append(record))
        if self._trackers is not None:
            self._trackers.log(record, int(record.get("step", 0)))
        if self._bar is not None:
            self._bar.show(record)
        else:
            self.info(_format(record))

    def summary(self, record: dict[str, Any]) -> None:
        """The run's final record: summary.json and the last line of metrics.jsonl (collective)."""
        self._close_bar()

        def write() -> None:
            self._write_json("summary.json", record)
            self._append({"summary": record})

        on_rank_zero(write)
        if self._trackers is not None:  # what only the summary has: a final test pass's metrics
            self._trackers.log({k: v for k, v in record.items() if k.startswith("test_")},
                               int(record.get("steps", record.get("step", 0))))
        self.info("summary: " + _format(record))

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self._close_bar()
        if self._trackers is not None:
            self._trackers.finish()
            self._trackers = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


class QuietRunLog(RunLog):
    """What ranks other than 0 get: silent, except for warnings tagged with the rank.

    It joins the collective writes of `RunLog` (rank 0 does them); its own part of each is
    nothing, also where it runs as the only process.
    """

    def __init__(self, rank: int) -> None:  # no files, no stream
        self.rank = rank
        self._bar = None
        self._metrics = None
        self._trackers = None  # rank 0's

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        print(f"[ddp_amp rank {self.rank}] warning: {message}", file=sys.stderr, flush=True)

    def start_progress(self, total: int, initial: int = 0) -> None:
        pass

    def _append(self, record: dict[str, Any]) -> None:
        pass

    def _write_json(self, name: str, payload: dict[str, Any]) -> None:
        pass

    def _start_trackers(self, specs: list[str], config: dict[str, Any], start_step: int) -> None:
        pass  # rank 0's

    def _rewind(self, step: int) -> int:
        return 0


def make_run_log(rank: int, run_dir: Path) -> RunLog:
    return RunLog(run_dir) if rank == 0 else QuietRunLog(rank)
