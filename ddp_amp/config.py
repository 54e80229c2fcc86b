"""The run's configuration: `TrainConfig`, composed of the components' own options.

Each component declares its options in a small frozen dataclass next to its code, with a
help text per field that doubles as `--help` and a `check` of its own (`PrecisionOptions`
in `amp`, `ParallelOptions` in `parallel`, `DataOptions` in `data`, `CheckpointOptions`,
`GuardOptions`, `LogOptions`, `DistOptions`); the Trainer's own are here. `TrainConfig`
inherits them all, so its fields stay flat (`TrainConfig(seed=3)`, `config.batch_size`,
one flag per field) and each default exists once, in its component. Building one checks
every component and then what concerns the run as a whole, so a config built in code,
from flags or from a `--config` file (`command_line.py`) is checked alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ddp_amp.amp.options import PrecisionOptions
from ddp_amp.checkpoint.options import CheckpointOptions
from ddp_amp.data.options import DataOptions
from ddp_amp.distributed.options import DistOptions
from ddp_amp.errors import UsageError
from ddp_amp.guards.options import GuardOptions, WatchOptions
from ddp_amp.metrics.options import LogOptions
from ddp_amp.option_values import (
    FIELD_NAMES,
    INT_LIMIT,
    STEP_WINDOW,
    ComponentOptions,
    StepWindow,
    check_fields,
    flag_of,
    option,
)
from ddp_amp.parallel.options import ParallelOptions, check_gather_dtype

__all__ = ["LaunchOptions", "TaskOptions", "TrainConfig", "TrainingOptions", "flag_of", "match_fields",
           "same_setting", "text_of"]


@dataclass(frozen=True)
class TaskOptions(ComponentOptions):
    """Which task trains, and the options the task reads itself."""

    task: str = option("lm", "built-in task: lm (transformer LM on Python's own docs), digits "
                       "(scikit-learn digits, needs ddp_amp[sklearn]), mlp (synthetic benchmark), causal_lm (a "
                       "Hugging Face model on your --data, needs ddp_amp[text]); "
                       "or a plugin 'package.module:function' that takes this config and returns a ddp_amp.Task",
                       resume="match")
    task_opt: tuple[str, ...] = option((), "task option KEY=VALUE, repeatable; read by the task "
                                       "(e.g. --task-opt hidden=256)", resume="match")

    def check(self) -> None:
        """Every task option is KEY=VALUE."""
        for item in self.task_opt:
            if "=" not in item:
                raise UsageError("--task-opt", item, "KEY=VALUE", "e.g. --task-opt hidden=256")

    def task_options(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.task_opt)


@dataclass(frozen=True)
class LaunchOptions(ComponentOptions):
    """About this launch rather than the run: where it lives, how it reports errors, which
    settings it may change on resume. Left out of `--print-config`."""

    run_dir: str = option("", "directory for config, metrics, checkpoints and the summary; default "
                          "runs/<task>-<id>: the SLURM job id, else torchrun's rendezvous id where it "
                          "names this run, else a new name; restarts and requeues of a job find it again",
                          resume="free", launch=True)
    run_name: str = option("", "name the run: its directory is runs/<name> (instead of --run-dir)",
                           resume="free", launch=True)
    debug: bool = option(False, "show full tracebacks on errors", resume="free", launch=True)
    allow_change: tuple[str, ...] = option((), "comma list of settings that must match on resume (marked so in "
                                           "this help) whose change you accept, e.g. seed,task_opt", resume="free",
                                           kind=FIELD_NAMES, launch=True)

    def check(self) -> None:
        """One way to name the run directory, and a run name that is a plain name."""
        if self.run_dir and self.run_name:
            raise UsageError("--run-name", self.run_name, "either --run-dir or --run-name, not both",
                             "--run-name NAME is short for --run-dir runs/NAME")
        if self.run_name in (".", "..") or "/" in self.run_name or "\\" in self.run_name:
            raise UsageError("--run-name", self.run_name, "a plain name (no path separators)",
                             "use --run-dir for a path")


@dataclass(frozen=True)
class TrainingOptions(ComponentOptions):
    """The Trainer's own: how long, with which optimizer, its evaluation and profile cadences."""

    max_steps: int = option(200, "optimizer steps to run (skipped fp16 steps count as steps)", limits=(1, INT_LIMIT))
    lr: float = option(0.0, "learning rate; 0 means the task's own default. A resume with another "
                       "value scales the optimizer's (and scheduler's) learning rates to it", limits=(0, 1e6))
    optimizer: str = option("auto", "optimizer: auto (the task's own, else AdamW), adamw, sgd",
                            ("auto", "adamw", "sgd"), resume="match")
    optimizer_impl: str = option("auto", "optimizer kernels for adamw/sgd: auto (fused where "
                                 "available, else foreach), fused, foreach, forloop",
                                 ("auto", "fused", "foreach", "forloop"))
    clip_grad_norm: float = option(0.0, "clip the global grad norm to this after unscaling; 0 = the "
                                   "task's default (lm: 0.5, others: off)", limits=(0, 1e12))
    seed: int = option(0, "seed for model init (same on all ranks) and data order; rank r "
                       "seeds its own RNGs with seed + r after the model is built", resume="match",
                       limits=(0, 2**63 - 1))
    eval_every: int = option(50, "run the task's metric on its held-out data before the first step "
                             "and every N optimizer steps (all ranks, under autocast); 0 = only "
                             "once, at the end, for the summary", limits=(0, INT_LIMIT))
    profile_steps: StepWindow | None = option(None, "A:B: record torch.profiler over optimizer steps A to B on "
                                              "every rank into <run-dir>/profile/ (TensorBoard and Perfetto open "
                                              "it); rank 0 prints the top ops per step", resume="free",
                                              kind=STEP_WINDOW)
    memory_snapshot: bool = option(False, "CUDA only: record the allocator's history and write a memory snapshot "
                                   "to <run-dir>/profile/ at the end of the profile window or training, and on "
                                   "out-of-memory", resume="free")

    def check(self) -> None:
        """Choices and ranges."""
        check_fields(self, TrainingOptions)


# Fields are collected from the last base to the first, so the options read (in --help,
# config.json) from the task down to the parallelism.
@dataclass(frozen=True)
class TrainConfig(ParallelOptions, GuardOptions, CheckpointOptions, LogOptions, DistOptions, PrecisionOptions,
                  DataOptions, TrainingOptions, LaunchOptions, TaskOptions):
    """Everything `python -m ddp_amp.train` can be told. Field help is the `--help` text.

    Options written as text (signals, step windows, metric goals, name lists) may be given
    as that text or as their value; they hold their value once built (`option_values`).
    Each component takes its own part with `<Component>Options.of(config)`; the methods
    below hand the Trainer those parts, so it need not import the layers that own them.
    """

    def precision_options(self) -> PrecisionOptions:
        return PrecisionOptions.of(self)

    def dist_options(self) -> DistOptions:
        return DistOptions.of(self)

    def parallel_options(self) -> ParallelOptions:
        return ParallelOptions.of(self)

    def data_options(self) -> DataOptions:
        return DataOptions.of(self)

    def checkpoint_options(self) -> CheckpointOptions:
        return CheckpointOptions.of(self)

    def guard_options(self) -> GuardOptions:
        return GuardOptions.of(self)

    def log_options(self) -> LogOptions:
        return LogOptions.of(self)

    def watch_options(self) -> WatchOptions:
        """The watchdogs' settings: the loss-scale rules, and the cadences they run on."""
        return WatchOptions(self.loss_scale(), self.check_sync_every, self.log_every)

    def check(self) -> None:
        """Each component's own checks, then those that concern the run as a whole."""
        TaskOptions.check(self)
        LaunchOptions.check(self)
        TrainingOptions.check(self)
        DataOptions.check(self)
        PrecisionOptions.check(self)
        DistOptions.check(self)
        LogOptions.check(self)
        CheckpointOptions.check(self)
        GuardOptions.check(self)
        ParallelOptions.check(self)
        if self.cpu_offload and (self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())):
            # Offloading frees GPU memory; a CPU run holds its shards on the host already.
            raise UsageError("--cpu-offload", True, "a CUDA run (--device cuda, or auto on a machine with a GPU)",
                             "drop --cpu-offload on a CPU run: its shards are on the host already")
        if self.shard:  # under auto, the session refuses it once the device says fp16
            check_gather_dtype(self.shard_param_dtype, self.precision, ("--shard-param-dtype", "--precision"))
        must_match = match_fields()
        for name in self.allow_change:
            if name not in must_match:
                raise UsageError("--allow-change", name, "names of settings that must match on resume: "
                                 + ", ".join(must_match), "other settings may change without it")

    def to_dict(self) -> dict[str, Any]:
        """Every option as the text or number a flag takes (what config.json records)."""
        return {f.name: text_of(self, f.name) for f in dataclasses.fields(self)}

    def run_options(self) -> dict[str, Any]:
        """`to_dict()` less the options about one launch (run directory, resume, debug):
        what `--print-config` writes, so its file describes a run and starts a new one."""
        return {f.name: text_of(self, f.name) for f in dataclasses.fields(self) if not f.metadata["launch"]}


def text_of(config: TrainConfig, name: str) -> Any:
    """Option `name` of `config` as a flag would give it (its value where it is no text kind)."""
    kind = config.__dataclass_fields__[name].metadata["kind"]
    value = getattr(config, name)
    return kind.text(value) if kind is not None else value


def same_setting(name: str, saved: Any, now: Any) -> bool:
    """Whether option `name` saved as `saved` (config.json's text) equals `now` (also text),
    compared as values: `eval_nll` and `eval_nll:min` are one goal, `TERM,USR1`..."""
    kind = TrainConfig.__dataclass_fields__[name].metadata["kind"]
    if isinstance(saved, list):  # JSON keeps tuples as lists
        saved = tuple(saved)
    if kind is not None and isinstance(saved, bool):  # a switch that grew choices, as an older run saved it
        saved = kind.text(saved)
    if kind is not None and isinstance(saved, str) and isinstance(now, str):
        try:
            return kind.parse(saved, flag_of(name)) == kind.parse(now, flag_of(name))
        except UsageError:  # a value an older version accepted: compare the text
            return saved == now
    return saved == now


def match_fields() -> tuple[str, ...]:
    """The settings a resume refuses to change (unless accepted with --allow-change)."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["resume"] == "match")
