"""`--profile-steps A:B`: torch.profiler over optimizer steps A to B on every rank, and
`--memory-snapshot`: CUDA allocator history, dumped on out-of-memory.

Each rank writes `<run-dir>/profile/rank<r>.<time>.pt.trace.json` (torch's TensorBoard
trace handler: TensorBoard's profiler view reads the folder, Perfetto and chrome://tracing
open the file). Rank 0 then prints the ops that took the most time, per step. The window
is counted in the log's step numbers (step A is the A-th optimizer step); a run resumed past
part of it profiles what is left.

A memory snapshot (CUDA only) records every allocation's stack from the start of training;
it is written to `<run-dir>/profile/memory-rank<r>.pickle` at the end of the profile window
(or of training) and when a step runs out of memory, before the error propagates. Open it
at https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from ddp_amp.errors import UsageError
from ddp_amp.option_values import StepWindow
from ddp_amp.torch_api import dump_memory_snapshot, profiler_keeps_events, record_memory_history

TOP_OPS = 10  # rows of the per-step table rank 0 prints


def top_ops_table(prof: profile, steps: int, device_type: str) -> str:
    """The ops with the most self time, per step: name, calls, host ms (and device ms)."""
    on_device = device_type == "cuda"
    key = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")), key=key, reverse=True)
    header = f"{'op':<48} {'calls':>7} {'host ms':>9}" + (f" {'device ms':>10}" if on_device else "")
    lines = [f"top ops per step over {steps} step(s):", header]
    for event in events[:TOP_OPS]:
        line = f"{event.key[:48]:<48} {event.count / steps:>7.1f} {event.self_cpu_time_total / 1000 / steps:>9.3f}"
        if on_device:
            line += f" {event.self_device_time_total / 1000 / steps:>10.3f}"
        lines.append(line)
    return "\n".join(lines)


class ProfileWindow:
    """Starts the profiler before step `first`, stops it after step `last` (log step numbers)."""

    def __init__(self, window: StepWindow | None, memory_snapshot: bool, out_dir: Path | None, rank: int,
                 device: torch.device, info: Callable[[str], None]) -> None:
        if memory_snapshot and device.type != "cuda":
            raise UsageError("--memory-snapshot", True, "a CUDA device (it records the CUDA allocator)",
                             "drop --memory-snapshot on a CPU run")
        self.first, self.last = window or (0, -1)
        self.memory_snapshot = memory_snapshot and device.type == "cuda"
        self.out_dir, self.rank, self.device, self.info = out_dir, rank, device, info
        self._prof: profile | None = None
        self._steps = 0
        if self.memory_snapshot:
            record_memory_history(max_entries=100_000)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def before_step(self, step: int) -> None:
        """Before optimizer step `step + 1` (the trainer's `step` counts steps done)."""
        if self._prof is None and self.out_dir is not None and self.first <= step + 1 <= self.last:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            length = self.last - step
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            with warnings.catch_warnings():  # a window of its own needs no warm-up steps
                warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
                self._prof = profile(activities=activities,
                                     schedule=schedule(wait=0, warmup=0, active=length, repeat=1),
                                     **profiler_keeps_events(),
                                     on_trace_ready=tensorboard_trace_handler(str(self.out_dir),
                                                                              worker_name=f"rank{self.rank}"))
                self._prof.start()
            self._steps, self._from = 0, step + 1

    def after_step(self, step: int) -> None:
        """After optimizer step `step` (log numbering)."""
        if self._prof is None:
            return
        self._steps += 1
        self._prof.step()
        if step >= self.last:
            self.finish()

    def finish(self) -> None:
        """Stop a window still open (training ended inside it) and dump the memory snapshot."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
            if self.rank == 0:
                self.info(top_ops_table(prof, max(self._steps, 1), self.device.type))
                self.info(f"profile of steps {self._from}-{self._from + self._steps - 1} written to {self.out_dir}")
        self.dump_memory("")

    def dump_memory(self, why: str) -> None:
        if self.memory_snapshot and self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"memory-rank{self.rank}.pickle"
            dump_memory_snapshot(str(path))
            if why:
                self.info(f"memory snapshot ({why}) written to {path}")
