"""Preemption: a signal only sets a flag; the loop stops at a step boundary all ranks agree on.

A cluster warns a job before it takes the nodes away (SLURM: `--signal=USR1@120`, or TERM
at the time limit). Doing real work inside a signal handler is unsafe (it can interrupt a
collective or a half-written file), so the handler records the signal and returns. The
trainer asks `PreemptionWatch.should_stop(step)` after each optimizer step; on some steps
that runs one tiny all-reduce (MAX) so that any rank's signal stops every rank at the same
step. The checkpoint is then written in normal control flow, and under SLURM rank 0 asks
`scontrol requeue` to put the job back in the queue, where it resumes from that checkpoint.

How often to agree: every check costs a collective and, on a GPU, a host sync that stalls
the launch queue (a bare 1-element gloo all-reduce took ~180 us on a 2-core CPU,
docs/facts.md). The watch checks about every `check_s` seconds of training instead of
every step: the all-reduce also carries each rank's measured step time (MAX), so every
rank computes the same next check step.
"""

from __future__ import annotations

import functools
import logging
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from types import FrameType, TracebackType
from typing import Any

import torch

from ddp_amp.dist import all_reduce_, on_rank_zero
from ddp_amp.errors import UsageError

log = logging.getLogger(__name__)

# Exit status of a run that stopped early for a preemption: EX_TEMPFAIL, "try again later".
EXIT_PREEMPTED = 75
MAX_CHECK_INTERVAL = 10_000
_NAMES = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT")


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
    """'USR1,TERM' (or 'SIGUSR1,sigterm') -> the signals; 'none' -> no handling."""
    if spec.strip().lower() in ("", "none"):
        return ()
    found: list[signal.Signals] = []
    for raw in spec.split(","):
        name = raw.strip().upper().removeprefix("SIG")
        if name not in _NAMES:
            raise UsageError("--preempt-signal", raw.strip(), "a comma list of " + ", ".join(_NAMES)
                             + ", or none", "SLURM's --signal=USR1@120 needs USR1")
        found.append(signal.Signals[f"SIG{name}"])
    return tuple(dict.fromkeys(found))


def _ignore(signums: tuple[int, ...], worker_id: int) -> None:
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)


def worker_ignores(signums: tuple[signal.Signals, ...]) -> functools.partial[None]:
    """A DataLoader `worker_init_fn` that ignores the preemption signals (picklable).

    SLURM signals every process of a step, DataLoader workers included; a worker killed by
    USR1/TERM would make the main process fail before it can checkpoint.
    """
    return functools.partial(_ignore, tuple(int(s) for s in signums))


class PreemptionWatch:
    """Signal flag + periodic cross-rank agreement. Use as a context manager around the loop."""

    def __init__(self, signums: tuple[signal.Signals, ...], device: torch.device,
                 check_s: float = 2.0, distributed: bool = True) -> None:
        if check_s <= 0:
            raise UsageError("--preempt-check-s", check_s, "seconds > 0", "e.g. 2")
        self.signums = signums
        self.device = device
        self.check_s = check_s
        self.distributed = distributed
        self.received: signal.Signals | None = None  # first signal seen on this rank
        self.stopped_by: str = ""  # name of the signal that stopped the job (any rank's)
        self._previous: dict[int, Any] = {}
        self._next_check = 1
        self._last_step = 0
        self._last_time = time.perf_counter()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the loop acts on it at the next agreed step boundary.
        if self.received is None:
            self.received = signal.Signals(signum)

    def install(self) -> None:
        """Install the handlers (only possible from the main thread; else a warning)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals not handled: not in the main thread")
            return
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._last_time = time.perf_counter()  # the first check measures training, not setup

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionWatch:
        self.install()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.restore()

    def should_stop(self, step: int) -> bool:
        """True on every rank once any rank got a signal (collective on check steps).

        All ranks call it after every step with the same `step`; the check steps are the
        same on every rank because they come from all-reduced numbers only.
        """
        if not self.signums:
            return False
        if not self.distributed:  # a world of one: reading a flag costs nothing
            return self._stopping(self.received is not None, self.received)
        if step < self._next_check:
            return False
        now = time.perf_counter()
        per_step = (now - self._last_time) / max(step - self._last_step, 1)
        vote = torch.tensor([0.0 if self.received is None else float(self.received), per_step],
                            dtype=torch.float64, device=self.device)
        signum, slowest = all_reduce_(vote, op=torch.distributed.ReduceOp.MAX).tolist()
        interval = int(self.check_s / max(slowest, 1e-6))
        self._next_check = step + min(max(interval, 1), MAX_CHECK_INTERVAL)
        self._last_step, self._last_time = step, time.perf_counter()
        return self._stopping(signum > 0, signal.Signals(int(signum)) if signum > 0 else None)

    def _stopping(self, stop: bool, signum: signal.Signals | None) -> bool:
        if stop and signum is not None:
            self.stopped_by = signum.name
        return stop


def requeue_slurm_job(environ: Mapping[str, str], timeout_s: float = 30.0) -> tuple[bool, str]:
    """Ask SLURM to requeue this job (`scontrol requeue $SLURM_JOB_ID`); (done, message).

    Call on one rank only. Requeueing a running job makes SLURM end it (TERM, then KILL
    after KillWait) and start it again, so call it after the checkpoint is committed.
    """
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id:
        return False, "not a SLURM job (no SLURM_JOB_ID): resubmit it to resume"
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None:
        return False, f"scontrol not found on PATH: cannot requeue job {job_id}; resubmit it to resume"
    try:
        result = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"`scontrol requeue {job_id}` timed out; resubmit the job to resume"
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        return False, (f"`scontrol requeue {job_id}` refused: {reason} (submit with --requeue and "
                       "as a batch job); resubmit it to resume")
    return True, f"requeued SLURM job {job_id}; it resumes from the checkpoint when it restarts"


def stop_for_preemption(save_checkpoint: Any, requeue: bool, step: int, signal_name: str,
                        environ: Mapping[str, str], warn: Any) -> dict[str, Any]:
    """Checkpoint, then (rank 0, under SLURM) requeue; the record the run ends with (collective).

    `save_checkpoint` is the trainer's collective save (returns the path, or None if it
    failed), or None where this build has no checkpointing: then nothing is requeued,
    because a requeued job without a checkpoint would start over and could be preempted
    forever. The requeue runs once per job, on rank 0 (SLURM restarts every rank), and
    every rank learns whether it happened.
    """
    path = save_checkpoint() if callable(save_checkpoint) else None
    requeued, message = False, "requeue off (--preempt-requeue never)"
    if not callable(save_checkpoint):
        message = "no checkpoint support in this build: stopping without a checkpoint or requeue"
    elif path is None:  # a failed save: requeueing would repeat the lost steps, maybe forever
        message = "the checkpoint failed, so the job is not requeued; see the error above"
    elif requeue:
        requeued, message = on_rank_zero(lambda: requeue_slurm_job(environ))
    warn(f"stopped at step {step} after {signal_name}; checkpoint: {path or 'none'}; {message}")
    return {"preempted": True, "step": step, "signal": signal_name, "requeued": requeued,
            "checkpoint": str(path) if path else None}
