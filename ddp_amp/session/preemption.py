"""Preemption for a loop of one's own: the Trainer's stop, through the session.

    with session.preemption(run_dir=run_dir, start_step=step) as preemption:
        while step < max_steps:
            ...one optimizer step...
            step += 1
            if preemption.should_stop(step):   # agreed: every rank stops at the same step
                record = preemption.stop(step, lambda: session.save(root / step_dir_name(step), state))
                raise SystemExit(record["exit_code"])  # 75 after USR1: requeued under SLURM

or, keeping the loop at its level, `preemption = session.preemption(...).start()` before it
and `preemption.close()` after it, as `Session` has `start()` and `close()`.

It is the Trainer's machinery, not a copy of it (`ddp_amp.guards.preemption`): a signal only
sets a flag (`PreemptionWatch`); `should_stop` agrees across ranks on a cadence of about
`check_every_s` seconds of training; `stop` runs the caller's collective save in normal
control flow, prints one line on rank 0 and appends the `preempted` record to the run's
metrics.jsonl, then, after a requeue signal with the checkpoint committed, rank 0 asks
SLURM to requeue the job (`stop_for_preemption`). The exit code is the Trainer's: 75 after
a requeue signal, 128 + the signal after a stop signal (`exit_code_for`).
"""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from ddp_amp.distributed import DistContext
from ddp_amp.errors import UsageError
from ddp_amp.guards import PreemptionWatch, exit_code_for, stop_for_preemption, worker_ignores
from ddp_amp.metrics import QuietRunLog, RunLog
from ddp_amp.option_values import parse_signals



class _SetsStep(Protocol):  # `Session.set_step`
    def __call__(self, step: int, *, checkpoint: str | None = None) -> None: ...

log = logging.getLogger(__name__)

Signals = str | tuple[signal.Signals, ...]


def _signals(value: Signals, name: str) -> tuple[signal.Signals, ...]:
    return parse_signals(value, name) if isinstance(value, str) else tuple(dict.fromkeys(value))


class LoopPreemption:
    """Signal handlers, the agreed stop decision and the stop itself, for a `Session` loop.

    Use it as a context manager around the loop, or `start()` and `close()` it: the handlers
    are installed on entry (from the main thread) and the previous ones come back however the
    block ends.
    """

    def __init__(self, ctx: DistContext, set_step: _SetsStep, environ: Mapping[str, str], *, signals: Signals,
                 stop_signals: Signals, check_every_s: float, requeue: bool, max_requeues: int, run_dir: Path | None,
                 start_step: int) -> None:
        requeue_on, stop_on = _signals(signals, "signals"), _signals(stop_signals, "stop_signals")
        if set(requeue_on) & set(stop_on):
            raise UsageError("stop_signals", ",".join(s.name for s in stop_on), "signals not also in `signals`",
                             "a signal either requeues (signals) or stops (stop_signals)")
        if not check_every_s > 0:
            raise UsageError("check_every_s", check_every_s, "seconds > 0", "e.g. 2")
        if max_requeues < 0:
            raise UsageError("max_requeues", max_requeues, "a count >= 0", "e.g. 20")
        self.ctx, self.set_step, self.environ = ctx, set_step, environ
        self.requeue, self.max_requeues, self.start_step = requeue, max_requeues, start_step
        self.watch = PreemptionWatch(requeue_on, ctx.device, check_every_s, ctx.has_group, stop_signums=stop_on)
        # Rank 0 prints the stop line and appends the records; the others join its writes.
        self._log: RunLog | None = None
        if run_dir is not None:
            self._log = RunLog(Path(run_dir)) if ctx.is_main else QuietRunLog(ctx.rank)

    def __enter__(self) -> LoopPreemption:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def start(self) -> LoopPreemption:
        """Install the signal handlers (from the main thread): what entering the `with` block
        does, for a loop that keeps its level and calls `close()` when it ends."""
        self.watch.install(self.start_step)
        return self

    def close(self) -> None:
        """Give the previous handlers back and close the run log (idempotent)."""
        self.watch.restore()
        if self._log is not None:
            self._log.close()

    @property
    def worker_init_fn(self) -> functools.partial[None]:
        """A DataLoader `worker_init_fn` that keeps its workers alive through the signals
        (SLURM signals every process of the job step, the loader's workers included)."""
        return worker_ignores(self.watch.signums)

    @property
    def received(self) -> signal.Signals | None:
        """The first preemption signal this rank got (before any agreement), or None."""
        return self.watch.received

    def should_stop(self, step: int) -> bool:
        """True on every rank, at the same `step`, once any rank got a signal (collective on
        the check steps: call it on every rank after every step, with the same step). It
        also tells the session the step (`Session.set_step`)."""
        self.set_step(step)
        return self.watch.should_stop(step)

    def stop(self, step: int, save: Callable[[], Path | None]) -> dict[str, Any]:
        """Save, say so, and requeue where the signal asks for it (collective): the record.

        `save` is the loop's collective save, run on every rank; it returns the committed
        checkpoint's path (what `session.save` returns), and a `CheckpointError` it raises
        reaches every rank. The record has the Trainer's fields (`preempted`, `step`,
        `signal`, `action`, `checkpoint`, `requeued`, `signal_to_commit_s`) and `exit_code`,
        the code to exit with: 75 after a requeue signal, 128 + the signal after a stop one.
        """
        self.set_step(step)
        record = stop_for_preemption(save, self.watch, self.requeue, step, self.environ, self._report,
                                     self.max_requeues)
        if record["checkpoint"] is not None:
            self.set_step(step, checkpoint=record["checkpoint"])
        return {**record, "exit_code": exit_code_for(record)}

    def _report(self, record: dict[str, Any], message: str) -> None:
        if self._log is not None:
            self._log.event(record, message)
        elif self.ctx.is_main:
            print(f"[ddp_amp] {message}", flush=True)
