"""Layer 3: mixed precision, from the choice of dtype to the optimizer step.

- `precision`: `--precision auto|fp32|bf16|fp16` resolved per device, and the run's scaler;
- `autocast`: the autocast-inside-forward wrapper that sits inside DDP;
- `float8`: float8 linear layers for `--precision fp8` (`ddp_amp.parallel` converts them);
- `scaler`: the GradScaler whose skip decision every rank agrees on;
- `lossscale`: loss-scale rules (hysteresis, floor) and on-device skip counters;
- `step`: the one AMP step, shared by the Trainer and `Session`.

Imports only `errors` from ddp_amp, nothing above; wrapping a model
for DDP or sharding is `ddp_amp.parallel`'s.
"""

from ddp_amp.amp.autocast import AutocastModule, unwrap_model
from ddp_amp.amp.lossscale import LossScaleOptions, OverflowCounters, next_scale
from ddp_amp.amp.precision import PRECISION_CHOICES, Precision, cpu_has_native_bf16, resolve_precision
from ddp_amp.amp.scaler import AgreedGradScaler
from ddp_amp.amp.step import StepResult, amp_step, scaled_backward

__all__ = [
    "PRECISION_CHOICES", "AgreedGradScaler", "AutocastModule", "LossScaleOptions", "OverflowCounters",
    "Precision", "StepResult", "amp_step", "cpu_has_native_bf16", "next_scale", "resolve_precision",
    "scaled_backward", "unwrap_model",
]
