"""What watches a run and stops it safely: overflow forensics, the loss-scale guard, the
rank-consistency guard, preemption signals, and `RunWatch`, which runs them on the loop's
cadence.

- `finite`: no checkpoint is written from non-finite weights (bf16/fp32 NaN steps);
- `forensics`: after a skipped fp16 step, which rank's gradients went non-finite, where;
- `loss_scale`: stop a run whose fp16 loss scaling collapses, or whose loss is non-finite;
- `rank_sync`: do all ranks still hold the same model, scaler state and step;
- `preemption`: a signal sets a flag; every rank stops at the same step, checkpoints, and
  rank 0 asks SLURM to requeue the job;
- `watch`: `RunWatch` and its `WatchOptions`.

Imports `amp`, `distributed`, `metrics`, `errors`; never `checkpoint` (a stop is handed the save
as a function) or anything above.
"""

from ddp_amp.guards.finite import FiniteStateGuard
from ddp_amp.guards.forensics import OverflowProbe, describe
from ddp_amp.guards.loss_scale import LossScaleGuard, check_loss_finite
from ddp_amp.guards.preemption import (EXIT_PREEMPTED, EarlySignals, PreemptionWatch, exit_code_for,
                                       requeue_slurm_job, stop_for_preemption, worker_ignores)
from ddp_amp.guards.rank_sync import check_rank_sync, fingerprint
from ddp_amp.guards.options import WatchOptions
from ddp_amp.guards.watch import RunWatch

__all__ = [
    "EXIT_PREEMPTED", "EarlySignals", "FiniteStateGuard", "LossScaleGuard", "OverflowProbe", "PreemptionWatch",
    "RunWatch", "WatchOptions", "check_loss_finite", "check_rank_sync", "describe", "exit_code_for", "fingerprint",
    "requeue_slurm_job", "stop_for_preemption", "worker_ignores",
]
