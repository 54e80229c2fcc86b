"""Each component owns its options: `TrainConfig` is composed of them, every field comes from
exactly one component, `of` picks a component's part, and a component checks itself."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from ddp_amp.amp.lossscale import LossScaleOptions
from ddp_amp.amp.options import PrecisionOptions
from ddp_amp.checkpoint.options import CheckpointOptions
from ddp_amp.config import LaunchOptions, TaskOptions, TrainConfig, TrainingOptions
from ddp_amp.data.options import DataOptions
from ddp_amp.distributed.options import DistOptions
from ddp_amp.errors import UsageError
from ddp_amp.guards.options import GuardOptions
from ddp_amp.metrics.options import LogOptions
from ddp_amp.option_values import ComponentOptions, MetricGoal
from ddp_amp.parallel.options import ParallelOptions

COMPONENTS = (TaskOptions, LaunchOptions, TrainingOptions, DataOptions, PrecisionOptions, DistOptions, LogOptions,
              CheckpointOptions, GuardOptions, ParallelOptions)


def test_every_field_of_the_config_comes_from_one_component() -> None:
    owned = [f.name for component in COMPONENTS for f in dataclasses.fields(component)]
    assert len(owned) == len(set(owned))
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(TrainConfig))


@pytest.mark.parametrize("component", COMPONENTS, ids=lambda c: c.__name__)
def test_of_picks_a_components_part_of_the_config(component: type[ComponentOptions]) -> None:
    assert component.of(TrainConfig()) == component()
    config = TrainConfig(seed=3, precision="fp16", batch_size=32, static_graph=True, preempt_signal=(signal.SIGUSR2,),
                         keep_best=MetricGoal("eval_nll", "min"))
    picked = component.of(config)
    assert not isinstance(picked, TrainConfig)
    assert all(getattr(picked, f.name) == getattr(config, f.name) for f in dataclasses.fields(picked))  # type: ignore[arg-type]  # a dataclass


def test_a_component_built_alone_is_typed_and_checked() -> None:
    text = "USR2,HUP"  # an option's text is taken and parsed, as from a flag
    guards = GuardOptions(preempt_signal=text)  # type: ignore[arg-type]  # the text is the flag's value
    assert guards.preempt_signal == (signal.SIGUSR2, signal.SIGHUP)
    with pytest.raises(UsageError, match="--static-graph"):
        ParallelOptions(shard=True, static_graph=True)
    with pytest.raises(UsageError, match="--loss-scale-backoff"):
        PrecisionOptions(loss_scale_backoff=2.0)
    with pytest.raises(UsageError, match="--batch-size"):
        DataOptions(batch_size=0)


def test_the_loss_scale_defaults_are_the_amp_layers() -> None:
    assert PrecisionOptions().loss_scale() == LossScaleOptions() == TrainConfig().loss_scale()
