"""From the run's options to each component's own: where `TrainConfig` is taken apart.

`TrainConfig` (ddp_amp/config.py) is composed of the components' options; the layers below
the Trainer never see it. Each gets its own part (`config.precision_options()`, ...): the
run core a `Session` built from the precision, process and parallelism options, the
watchdogs `config.watch_options()`. `check_options` checks what only a component can, so the CLI
refuses it before anything starts.
"""

from __future__ import annotations

from ddp_amp.config import TrainConfig
from ddp_amp.metrics.trackers import check_tracker_spec
from ddp_amp.session import Session, ShardOptions
from ddp_amp.session.choices import FLAGS


def shard_options(config: TrainConfig) -> ShardOptions | None:
    """FSDP2's settings where the run shards its model, or splits it (tensor parallel: FSDP2
    then replicates it over the data-parallel ranks without --shard); None where DDP replicates it."""
    parallel = config.parallel_options()
    if not parallel.shard and not parallel.spread_by_fsdp:
        return None
    return ShardOptions(parallel.reshard_after_forward, parallel.activation_checkpointing,
                        replicate=parallel.replicate if parallel.shard else 0, param_dtype=parallel.shard_param_dtype,
                        cpu_offload=parallel.cpu_offload)


class CommandLineSession(Session):
    """The run core of a run from the command line: its refusals name the flags."""

    option_names = FLAGS


def session_for(config: TrainConfig) -> Session:
    """The run core as the options ask for it (enter it with `with`)."""
    precision, dist = config.precision_options(), config.dist_options()
    return CommandLineSession(precision.precision, dist.device, dist.backend, dist.dist_timeout,  # type: ignore[arg-type]  # strs, checked as choices
                   scaler_options=precision.loss_scale().scaler_kwargs(), fp8_emulate=precision.fp8_emulate,
                   shard=shard_options(config), liveness=dist.liveness(),
                   tensor_parallel=config.parallel_options().tensor_parallel,
                   context_parallel=config.parallel_options().context_parallel)


def check_options(config: TrainConfig) -> None:
    """What the components check of `config` themselves (a tracker's name), now: a one-line
    UsageError before a process group or a file exists."""
    for spec in config.log_options().tracker:
        check_tracker_spec(spec)

