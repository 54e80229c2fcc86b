"""The guard options of a run: the rank-consistency check's cadence, and preemption (a signal
-> an agreed stop -> a checkpoint -> a requeue)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from ddp_amp.amp.lossscale import LossScaleOptions
from ddp_amp.errors import UsageError
from ddp_amp.option_values import INT_LIMIT, SIGNALS, TEN_YEARS_S, ComponentOptions, check_fields, option, signals_text


@dataclass(frozen=True)
class GuardOptions(ComponentOptions):
    """What the watchdogs and the preemption watch are told (the loss-scale rules are the
    precision's: `PrecisionOptions`)."""

    check_sync_every: int = option(0, "every N steps compare a fingerprint of parameters, scaler state "
                                   "and step across ranks and stop if they differ (0 = only after a resume)",
                                   limits=(0, INT_LIMIT))
    preempt_signal: tuple[signal.Signals, ...] = option(
        (signal.SIGUSR1,), "signals that mean 'checkpoint at the next agreed step, then requeue' (exit 75): what "
        "SLURM sends before a time limit with --signal=B:USR1@<s>. Comma list of USR1, USR2, TERM, INT, HUP, QUIT, "
        "or none", kind=SIGNALS)
    stop_signal: tuple[signal.Signals, ...] = option(
        (signal.SIGTERM,), "signals that mean 'checkpoint if possible, then exit without a requeue' (exit 128 + "
        "the signal): scancel sends TERM, so a cancelled job stays cancelled. Same list as --preempt-signal, none "
        "of the same signals", kind=SIGNALS)
    preempt_check_s: float = option(2.0, "seconds of training between the cross-rank checks of the "
                                    "preemption flag (each check is one tiny all-reduce)", limits=(1e-12, TEN_YEARS_S))
    max_requeues: int = option(20, "requeue a preempted SLURM job at most this many times (its "
                               "SLURM_RESTART_COUNT); then stop with the checkpoint and say so. 0 never requeues",
                               limits=(0, 10**6))
    preempt_requeue: str = option("auto", "after a preemption stop: auto (rank 0 runs `scontrol "
                                  "requeue $SLURM_JOB_ID` under SLURM) or never", ("auto", "never"))

    def check(self) -> None:
        """Ranges and choices, and no signal that means both a requeue and a stop."""
        check_fields(self, GuardOptions)
        both = sorted(s.name for s in set(self.preempt_signal) & set(self.stop_signal))
        if both:
            raise UsageError("--stop-signal", signals_text(self.stop_signal), "signals not also in --preempt-signal",
                             f"{', '.join(both)} cannot mean both requeue and stop; drop it from one")


@dataclass(frozen=True)
class WatchOptions:
    """What the watchdogs need from the run's configuration."""

    loss_scale: LossScaleOptions = field(default_factory=LossScaleOptions)
    check_sync_every: int = 0  # steps between rank-consistency checks; 0 = only after a resume
    log_every: int = 20  # the logging cadence, which bounds how rarely a GPU reads the counters
