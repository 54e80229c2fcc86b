"""The loss-scale guard: stop a run whose fp16 loss scaling is failing, and a non-finite loss.

The scaler keeps on-device counts of consecutive skipped steps (`OverflowCounters` in
`ddp_amp.amp.lossscale`); this host-side check reads them and turns a collapse into a
`TrainingHalted` with advice, instead of letting the scale decay towards zero quietly.
"""

from __future__ import annotations

from ddp_amp.amp import AgreedGradScaler, LossScaleOptions, Precision
from ddp_amp.errors import TrainingHalted

_NOTHING_SAVED = "Nothing was checkpointed from this state. "
_ADVICE = _NOTHING_SAVED + Precision("fp16", "cpu").divergence_advice


class LossScaleGuard:
    """Stops training when fp16 loss scaling is failing instead of letting it decay quietly."""

    def __init__(self, options: LossScaleOptions) -> None:
        self.options = options

    def check(self, scaler: AgreedGradScaler, step: int) -> None:
        """Raise `TrainingHalted` if the skip counters crossed a limit (one host read).

        Every rank reads the same agreed counters, so every rank raises together.
        """
        if not scaler.is_enabled():
            return
        streak, floor_streak = scaler.overflow_counters.worst()
        limit = self.options.max_consecutive_skips
        if limit and streak >= limit:
            raise TrainingHalted(
                f"fp16 loss scaling failed at step {step}: {streak} consecutive optimizer steps were "
                f"skipped because the gradients held inf/NaN (limit --max-consecutive-skips {limit}); "
                f"loss scale now {scaler.get_scale():.4g}. " + _ADVICE)
        if self.options.min_scale > 0 and floor_streak >= self.options.hysteresis:
            raise TrainingHalted(
                f"fp16 loss scaling failed at step {step}: the loss scale reached its floor "
                f"{self.options.min_scale:g} (--loss-scale-min) and the gradients still overflowed "
                f"({floor_streak} skipped step(s) at the floor). " + _ADVICE)


def check_loss_finite(loss: float, step: int, precision: Precision) -> None:
    """Raise `TrainingHalted` for a non-finite logged loss (any precision)."""
    if loss == loss and abs(loss) != float("inf"):
        return
    raise TrainingHalted(f"the loss is {loss} at step {step} (mean over ranks, {precision.name}). "
                         + _NOTHING_SAVED + precision.divergence_advice)
