"""From the run's options to each component's own: where `TrainConfig` is taken apart.

`TrainConfig` holds typed values (ddp_amp/config.py); the layers below the Trainer never see
it. Each component gets its small options object: the run core its `Session`, the amp
layer `LossScaleOptions` (which the config builds and checks itself), the watchdogs
`WatchOptions`. `check_options` checks what only a component can, so the CLI refuses it
before anything starts.
"""

from __future__ import annotations

from ddp_amp.config import TrainConfig
from ddp_amp.guards import WatchOptions
from ddp_amp.metrics.trackers import check_tracker_spec
from ddp_amp.session import Session, ShardOptions


def watch_options(config: TrainConfig) -> WatchOptions:
    """The watchdogs' settings."""
    return WatchOptions(config.loss_scale_options(), config.check_sync_every, config.log_every)


def session_for(config: TrainConfig) -> Session:
    """The run core as the options ask for it (enter it with `with`)."""
    shard = ShardOptions(config.reshard_after_forward, config.activation_checkpointing) if config.shard else None
    return Session(config.precision, config.device, config.backend, config.dist_timeout,  # type: ignore[arg-type]
                   scaler_options=config.loss_scale_options().scaler_kwargs(), fp8_emulate=config.fp8_emulate,
                   shard=shard)


def check_options(config: TrainConfig) -> None:
    """What the components check of `config` themselves (a tracker's name), now: a one-line
    UsageError before a process group or a file exists."""
    for spec in config.tracker:
        check_tracker_spec(spec)
