"""The precision options of a run: `--precision`, `--fp8-emulate` and the fp16 loss-scale settings.

The loss-scale defaults are `LossScaleOptions`' own (lossscale.py): the flags' defaults are
read from it, as is a `Session`'s scaler where its caller names none, so a run from the
command line and a `Session` in a user's loop get the same floor and growth rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.amp.lossscale import LossScaleOptions
from ddp_amp.amp.precision import PRECISION_CHOICES
from ddp_amp.option_values import INT_LIMIT, ComponentOptions, check_fields, option

_DEFAULT = LossScaleOptions()


@dataclass(frozen=True)
class PrecisionOptions(ComponentOptions):
    """What a run computes in, and how fp16's loss scale moves."""

    precision: str = option("auto", "auto (bf16 on GPUs/CPUs with bf16 units, else fp16 on GPUs, "
                            "else fp32), fp32, bf16, fp16 (with loss scaling), or fp8 (bf16 plus float8 "
                            "linear layers on Ada/Hopper GPUs; needs ddp_amp[fp8])", PRECISION_CHOICES,
                            resume="precision")
    fp8_emulate: bool = option(False, "with --precision fp8: emulate the float8 matmuls, so fp8 runs on "
                               "any device (slow; for tests)")
    loss_scale_init: float = option(_DEFAULT.init_scale, "fp16: the loss scale to start from")
    loss_scale_growth_interval: int = option(_DEFAULT.growth_interval,
                                             "fp16: clean steps in a row before the scale doubles")
    loss_scale_backoff: float = option(_DEFAULT.backoff_factor,
                                       "fp16: factor the scale is multiplied by on overflow (0 < f < 1)")
    loss_scale_min: float = option(_DEFAULT.min_scale, "fp16: floor the scale never backs off below; overflows "
                                   "at the floor stop the run (0 = no floor)")
    loss_scale_hysteresis: int = option(_DEFAULT.hysteresis, "fp16: consecutive overflowing steps tolerated "
                                        "before the scale backs off (DeepSpeed's hysteresis); they are still skipped")
    max_consecutive_skips: int = option(_DEFAULT.max_consecutive_skips, "fp16: stop with an error after this many "
                                        "skipped steps in a row (0 = never)", limits=(0, INT_LIMIT))

    def check(self) -> None:
        """Raise a one-line UsageError for a bad choice or loss-scale setting (the amp layer's rules)."""
        check_fields(self, PrecisionOptions)
        PrecisionOptions.loss_scale(self).validate()

    def loss_scale(self) -> LossScaleOptions:
        """The `--loss-scale-*` settings as the amp layer takes them."""
        return LossScaleOptions(self.loss_scale_init, self.loss_scale_growth_interval, self.loss_scale_backoff,
                                self.loss_scale_min, self.loss_scale_hysteresis, self.max_consecutive_skips)

