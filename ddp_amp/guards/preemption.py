"""Preemption: a signal only sets a flag; the loop stops at a step boundary all ranks agree on.

A cluster warns a job before it takes the nodes away (SLURM: `--signal=USR1@120`, or TERM
at the time limit). Doing real work inside a signal handler is unsafe (it can interrupt a
collective or a half-written file), so the handler records the signal and returns. The
trainer asks `PreemptionWatch.should_stop(step)` after each optimizer step; on some steps
that runs one tiny all-reduce (MAX) so that any rank's signal stops every rank at the same
step. The checkpoint is then written in normal control flow, and under SLURM rank 0 asks
`scontrol requeue` to put the job back in the queue, where it resumes from that checkpoint.

How often to agree: every check costs a collective and, on a GPU, a host sync that stalls
the launch queue (docs/facts.md, "Timing noise, and what a collective costs"). The watch
checks about every `check_s` seconds of training instead of every step: the all-reduce also
carries each rank's measured step time (MAX), so every rank computes the same next check
step.
"""

from __future__ import annotations

import functools
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from ddp_amp.distributed import all_reduce_, on_rank_zero
from ddp_amp.errors import UsageError
from ddp_amp.startup_signals import EarlySignals

log = logging.getLogger(__name__)

# Exit status of a run that stopped early for a preemption: EX_TEMPFAIL, "try again later".
EXIT_PREEMPTED = 75
MAX_CHECK_INTERVAL = 10_000
NOT_SLURM = "not a SLURM job (no SLURM_JOB_ID): resubmit it to resume"


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
                 check_s: float = 2.0, distributed: bool = True,
                 stop_signums: tuple[signal.Signals, ...] = ()) -> None:
        if check_s <= 0:
            raise UsageError("--preempt-check-s", check_s, "seconds > 0", "e.g. 2")
        # `signums` ask for checkpoint + requeue, `stop_signums` for checkpoint + exit.
        self.requeue_signums = signums
        self.signums = tuple(dict.fromkeys(signums + stop_signums))
        self.device = device
        self.check_s = check_s
        self.distributed = distributed
        self.received: signal.Signals | None = None  # first signal seen on this rank
        self.received_at = 0.0  # time.monotonic() when it came
        # time.monotonic() on this rank when the first signal reached any rank: agreed at the
        # check that stopped the job (each rank sends how long ago its own came; 0.0 before).
        self.signalled_at = 0.0
        self.stopped_by: str = ""  # name of the signal that stopped the job (any rank's)
        self.requeue = False  # whether that signal asks for a requeue
        self._previous: dict[int, Any] = {}
        self._next_check = 1
        self._last_step = 0
        self._last_time = time.perf_counter()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the loop acts on it at the next agreed step boundary.
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()

    def install(self, step: int = 0) -> None:
        """Install the handlers for a loop that starts at `step` (a resumed run's, say).

        The check cadence is measured from `step`: measured from 0, a run resumed at step S
        would see S steps done in no time and put its next check out of reach.
        Only possible from the main thread; elsewhere a warning.
        """
        self._last_step, self._next_check = step, step + 1
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals not handled: not in the main thread")
            return
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self._on_signal)
            early = getattr(self._previous[signum], "__self__", None)
            if isinstance(early, EarlySignals) and early.received is not None and self.received is None:
                self.received, self.received_at = early.received, early.received_at  # came during start-up
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
            return self._stopping(self.received is not None, self.received, self._signal_age())
        if step < self._next_check:
            return False
        now = time.perf_counter()
        per_step = (now - self._last_time) / max(step - self._last_step, 1)
        vote = torch.tensor([0.0 if self.received is None else float(self.received), per_step, self._signal_age()],
                            dtype=torch.float64, device=self.device)
        signum, slowest, age = all_reduce_(vote, op=torch.distributed.ReduceOp.MAX).tolist()
        interval = int(self.check_s / max(slowest, 1e-6))
        self._next_check = step + min(max(interval, 1), MAX_CHECK_INTERVAL)
        self._last_step, self._last_time = step, time.perf_counter()
        return self._stopping(signum > 0, signal.Signals(int(signum)) if signum > 0 else None, age)

    def _signal_age(self) -> float:
        """Seconds since this rank's signal came (0.0 without one): an interval of this rank's
        own clock, so the ranks' MAX is the oldest signal's age whatever their clocks read."""
        return time.monotonic() - self.received_at if self.received is not None else 0.0

    def _stopping(self, stop: bool, signum: signal.Signals | None, age: float) -> bool:
        if stop and signum is not None:
            self.stopped_by = signum.name
            self.requeue = signum in self.requeue_signums
            self.signalled_at = time.monotonic() - age
        return stop


def _run_deaf_to_term(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command)` with SIGTERM ignored in the child.

    The requeue it asks for makes SLURM send TERM to every process of the job step, this
    child included: killed before it exits, a `scontrol requeue` that worked would read
    as refused (exit code -15). An ignored signal stays ignored across exec, so the parent
    ignores TERM while it starts the child; a TERM that lands then asks for the stop that is
    under way. Outside the main thread (or over a handler set outside Python) the child
    starts as it is.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is None:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    finally:
        signal.signal(signal.SIGTERM, previous)


def requeue_slurm_job(environ: Mapping[str, str], timeout_s: float = 30.0) -> tuple[bool, str]:
    """Ask SLURM to requeue this job (`scontrol requeue $SLURM_JOB_ID`); (done, message).

    Call on one rank only. Requeueing a running job makes SLURM end it (TERM, then KILL
    after KillWait) and start it again, so call it after the checkpoint is committed and
    everything the run has to say is out.
    """
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id:
        return False, NOT_SLURM
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None:
        return False, f"scontrol not found on PATH: cannot requeue job {job_id}; resubmit it to resume"
    try:
        result = _run_deaf_to_term([scontrol, "requeue", job_id], timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"`scontrol requeue {job_id}` timed out; resubmit the job to resume"
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        return False, (f"`scontrol requeue {job_id}` refused: {reason} (submit with --requeue and "
                       "as a batch job); resubmit it to resume")
    return True, f"requeued SLURM job {job_id}; it resumes from the checkpoint when it restarts"


def exit_code_for(record: dict[str, Any]) -> int:
    """75 (try again later) after a requeue signal, 128 + the signal after a stop signal."""
    if record.get("action") == "requeue":
        return EXIT_PREEMPTED
    return 128 + int(signal.Signals[record["signal"]])


@contextmanager
def _term_held() -> Iterator[None]:
    """SIGTERM only sets a flag inside the block, where nothing else handles it.

    SLURM ends a requeued or cancelled job with TERM (KILL after KillWait). Where TERM is a
    stop signal the watch's handler flags it already; where it is not (`--stop-signal
    none`), its default action would end the process in the middle of the checkpoint or
    before the stop line is out. A TERM that lands while the run stops asks for what is
    happening already. Only the main thread can install handlers; elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _not_requeued_because(action: str, stopped_by: str, path: Path | None, requeue_allowed: bool,
                          environ: Mapping[str, str], max_requeues: int) -> str:
    """Why this stop does not ask SLURM for a requeue; "" where it does."""
    restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if action == "stop":
        return f"{stopped_by} means stop: not requeued"
    if path is None:
        return "the checkpoint failed, so the job is not requeued; see the error below"
    if restarts >= max_requeues:
        return (f"not requeued: this job was requeued {restarts} times already (--max-requeues "
                f"{max_requeues}); resubmit it to go on from the checkpoint")
    if not requeue_allowed:
        return "requeue off (--preempt-requeue never)"
    if not environ.get("SLURM_JOB_ID"):
        return NOT_SLURM
    return ""


def stop_for_preemption(save_checkpoint: Callable[[], Path | None], watch: PreemptionWatch, requeue_allowed: bool,
                        step: int, environ: Mapping[str, str], report: Callable[[dict[str, Any], str], None],
                        max_requeues: int) -> dict[str, Any]:
    """Checkpoint, then requeue where the signal asks for it; the record the run ends with.

    Collective. `save_checkpoint` is the trainer's collective save (the path, or None if
    it failed). A requeue signal (USR1 by default) requeues the SLURM job once the
    checkpoint committed; a stop signal (TERM: `scancel`, the kill at a time limit) never
    does, so a cancelled job stays cancelled. No requeue after a failed save (it would
    repeat the lost steps, maybe forever), nor past `max_requeues` requeues of this job.

    `report` (the run log's collective `event`) prints one line on rank 0 and writes the
    record to metrics.jsonl. The `preempted` record and its line ("...; requeuing SLURM job
    N") go out before SLURM is asked: the requeue ends this job step (TERM, then KILL), so
    what comes after it may never be seen. Then rank 0 runs `scontrol requeue`, every rank
    learns whether it happened, and a `requeue` record says so. TERM cannot end the process
    meanwhile (`_term_held`).
    """
    with _term_held():
        path = save_checkpoint()
        committed = time.monotonic()
        action = "requeue" if watch.requeue else "stop"
        why_not = _not_requeued_because(action, watch.stopped_by, path, requeue_allowed, environ, max_requeues)
        record = {"event": "preempted", "step": step, "signal": watch.stopped_by, "action": action,
                  "checkpoint": str(path) if path else None, "requeuing": not why_not,
                  "signal_to_commit_s": round(committed - watch.signalled_at, 3) if watch.signalled_at else None}
        next_ = why_not or f"requeuing SLURM job {environ.get('SLURM_JOB_ID')}"
        for stream in (sys.stdout, sys.stderr):  # what this process wrote before, out ahead of the line
            stream.flush()
        report(record, f"stopped at step {step} after {watch.stopped_by}; checkpoint: {path or 'none'}; {next_}")
        requeued = False
        if not why_not:
            requeued, message = on_rank_zero(lambda: requeue_slurm_job(environ))
            report({"event": "requeue", "step": step, "requeued": requeued}, message)
    return {"preempted": True, "step": step, "signal": watch.stopped_by, "action": action,
            "checkpoint": record["checkpoint"], "requeued": requeued,
            "signal_to_commit_s": record["signal_to_commit_s"]}
