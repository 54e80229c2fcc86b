"""The task contract shared by built-in tasks and user plugins, and the loader.

A task is made by a function that takes the run's `TrainConfig` and returns a `Task`.
`--task NAME` picks a built-in one; `--task package.module:function` a user's own.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

# What a task's make_loader is given: defined with the streams that build it, imported from here.
from ddp_amp.data import LoaderFactory as LoaderFactory
from ddp_amp.data import LoaderRequest as LoaderRequest
from ddp_amp.parallel import Units
from ddp_amp.errors import UsageError

if TYPE_CHECKING:
    from ddp_amp.config import TrainConfig

OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
# metric(output, target) -> {name: (sum over the batch, number of items)}; sums and counts
# are added up over batches and ranks before the division, so the result is exact.
MetricFn = Callable[[Any, Any], Mapping[str, tuple[torch.Tensor, int]]]
# finalize(means) -> metrics to report: applied to the reduced means, for metrics that are
# not means themselves (perplexity is exp of the mean NLL).
FinalizeFn = Callable[[dict[str, float]], dict[str, float]]
# step_fn(model, batch) -> the loss, or a mapping with "loss" and other scalars to log: a
# task's own step, for batches and forwards of any shape (trainer/batch_loss.py).
StepFn = Callable[[nn.Module, Any], Any]

BUILTIN_TASKS: dict[str, str] = {
    "mlp": "ddp_amp.tasks.mlp:make_task",
    "lm": "ddp_amp.tasks.lm:make_task",
    "digits": "ddp_amp.tasks.digits:make_task",
    "causal_lm": "ddp_amp.tasks.causal_lm:make_task",
}


@dataclass
class Task:
    """What a task hands the trainer.

    How a batch becomes a loss: `loss_fn(model(input), target)` for `(input, target)`
    items; or `step_fn(model, batch)` for items of any structure (dicts, several inputs);
    or, with neither, the model's own output's `loss` (Hugging Face style). Items of any
    structure (tensors, tuples, lists, dicts, namedtuples, dataclasses) are collated and
    moved to the device field by field. Held-out data is scored by `metric` or `eval_fn`;
    without either, by that same loss, as `eval_loss` (a mean over items, as Hugging Face's
    Trainer reports it).
    """

    model: nn.Module | None = None  # or build_model
    train_data: Dataset | None = None  # or make_loader
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    eval_data: Dataset | None = None  # scored by `metric` or `eval_fn`, else by its loss: eval_loss
    metric: MetricFn | None = None
    make_optimizer: OptimizerFactory | None = None  # None: AdamW; may return a list (stepped together)
    make_scheduler: SchedulerFactory | None = None  # stepped as schedule_on says
    default_lr: float = 1e-3
    name: str = ""
    finalize_metrics: FinalizeFn | None = None  # None: report the means as they are
    default_clip_grad_norm: float = 0.0  # used when --clip-grad-norm is 0; 0 = no clipping
    step_fn: StepFn | None = None  # instead of loss_fn: the task's own micro-step loss
    test_data: Dataset | None = None  # scored with `metric` once, after training: test_* in the summary
    # When make_scheduler's scheduler is stepped: "step" (each optimizer step taken),
    # "epoch" (each pass over train_data) or "eval:METRIC" (after each evaluation, with
    # that metric: ReduceLROnPlateau). trainer/schedules.py.
    schedule_on: str = "step"
    # What the task keeps across steps on each rank (a TBPTT hidden state, say), as an
    # object with state_dict() / load_state_dict(); every checkpoint saves each rank's and
    # a resume gives each rank its own back. The task's step_fn reads and updates it.
    state: Any = None
    # Instead of metric, for batches that are not (input, target): eval_fn(model, batch) ->
    # {name: (sum Tensor, count)}, summed over batches and ranks like metric's.
    eval_fn: Callable[[nn.Module, Any], Mapping[str, tuple[torch.Tensor, int]]] | None = None
    # Instead of train_data: make_loader(LoaderRequest) -> this rank's loader of training
    # micro-batches, sharded by the task (a DistributedSampler, say), with state_dict() and
    # load_state_dict() for an exact resume (torchdata's StatefulDataLoader). One pass over
    # it is an epoch. ddp_amp/data/task_loader.py.
    make_loader: LoaderFactory | None = None
    # Tokens in one training item (a language model's sequence length): the log's
    # tokens_per_s is samples/s times this; 0 = the task has no tokens.
    tokens_per_sample: int = 0
    # The model's blocks, each sharded as a unit under --shard: module classes, or a function
    # of the model returning its modules; None: the children of its largest nn.ModuleList,
    # else its direct children that hold parameters (ddp_amp/parallel/fsdp.py).
    shard_units: Units = None
    # Instead of model: a function that builds it, called once per rank with torch seeded by
    # --seed. Under --shard each rank builds only its shards' rows of every parameter (never
    # the whole model; equal to a plain build's), so a model larger than one host's memory
    # can be trained: ddp_amp/parallel/meta_init.py.
    build_model: Callable[[], nn.Module] | None = None
    # What the training data is, where the task reads --data (a digest of the tokenized caches
    # it trains on): checkpoints record it, and a resume whose data changed is refused
    # unless --allow-change data. "" for a task that does not read --data.
    data_identity: str = ""
    # Files `export --hf` writes beside the weights (a tokenizer's), copied into the run
    # directory when the run starts so the export finds them even if the originals go.
    hf_files: tuple[str, ...] = ()
    # count_loss_items(batch) -> how many items (target tokens, say) a micro-batch holds: with
    # it, the task's loss (step_fn's, loss_fn's or the model's) is a sum over those items, not a
    # mean, and the Trainer divides each optimizer step's sums by the step's count over every
    # micro-batch and rank, so the step's loss is the mean over its items on any split of the
    # global batch (ddp_amp/trainer/micro_steps.py). None: the loss is a mean per micro-batch.
    count_loss_items: Callable[[Any], Any] | None = None
    # How --tensor-parallel splits the model: module name patterns (`*` for one part of a dotted
    # name) -> style: "colwise", "rowwise" (Linears split by output and input features),
    # "embedding", "head" (the output layer, its logits left split for the loss), "norm"
    # (sequence parallel). None: a transformers model's own plan (ddp_amp/parallel/tensor_parallel.py).
    tensor_parallel_plan: Mapping[str, str] | None = None


def parse_task_options(options: Mapping[str, str],
                       defaults: Mapping[str, int | float | str]) -> dict[str, Any]:
    """`--task-opt KEY=VALUE` pairs over a task's defaults, each converted to its default's type.

    Unknown keys and values that do not convert raise a UsageError; range checks are the
    task's own.
    """
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        example = next(iter(defaults))
        raise UsageError("--task-opt", unknown[0], "one of " + ", ".join(defaults),
                         f"e.g. --task-opt {example}={_shown(defaults[example])}")
    values: dict[str, Any] = dict(defaults)
    for key, raw in options.items():
        kind = type(defaults[key])
        try:
            values[key] = kind(raw)
        except ValueError:
            raise UsageError(f"--task-opt {key}", raw, "an integer" if kind is int else "a number",
                             f"e.g. --task-opt {key}={_shown(defaults[key])}") from None
        if kind is not str and not math.isfinite(values[key]):
            raise UsageError(f"--task-opt {key}", raw, "a finite number", f"e.g. --task-opt {key}={defaults[key]:g}")
    return values


def _shown(default: int | float | str) -> str:
    return default if isinstance(default, str) else f"{default:g}"


def _check_task(spec: str, task: object) -> Task:
    if not isinstance(task, Task):
        raise UsageError("--task", spec, f"a function returning ddp_amp.Task, got {type(task).__name__}",
                         "return ddp_amp.Task(model=..., train_data=..., loss_fn=...)")
    if (task.model is None) == (task.build_model is None):
        raise UsageError("--task", spec, "exactly one of Task.model and Task.build_model",
                         "pass the module as model=, or a function that builds it as build_model=")
    if task.model is not None and not isinstance(task.model, nn.Module):
        raise UsageError("--task", spec, f"Task.model to be a torch.nn.Module, got {type(task.model).__name__}",
                         "build the model in the task function and pass the module itself")
    if task.build_model is not None and not callable(task.build_model):
        raise UsageError("--task", spec, f"Task.build_model to be a function, got {type(task.build_model).__name__}",
                         "pass the function itself (build_model=make_model), not its result")
    kind, colon, metric = task.schedule_on.partition(":") if isinstance(task.schedule_on, str) else ("", "", "")
    if kind not in ("step", "epoch", "eval") or (kind == "eval") != bool(colon and metric):
        raise UsageError("--task", spec, f"Task.schedule_on to be 'step', 'epoch' or 'eval:METRIC', "
                         f"got {task.schedule_on!r}", "e.g. schedule_on='eval:eval_nll' for ReduceLROnPlateau")
    if kind == "eval" and task.eval_data is None:
        raise UsageError("--task", spec, "Task.eval_data with schedule_on='eval:...'",
                         "a metric-driven schedule needs an evaluation to read")
    if task.state is not None and not all(callable(getattr(task.state, name, None))
                                          for name in ("state_dict", "load_state_dict")):
        raise UsageError("--task", spec, f"Task.state to have state_dict() and load_state_dict(), "
                         f"got {type(task.state).__name__}", "wrap what the task keeps in a small class with both")
    if task.test_data is not None and task.metric is None and task.eval_fn is None and task.step_fn is not None:
        raise UsageError("--task", spec, "Task.metric (or eval_fn) with Task.test_data and a Task.step_fn",
                         "the test pass scores it with the metric (a step_fn may change the task's state)")
    if (task.train_data is None) == (task.make_loader is None):
        raise UsageError("--task", spec, "Task.train_data or Task.make_loader (one of them)",
                         "give the dataset, or a function that builds this rank's loader")
    if task.make_loader is not None and not callable(task.make_loader):
        raise UsageError("--task", spec, f"Task.make_loader to be callable, got {type(task.make_loader).__name__}",
                         "make_loader=lambda request: StatefulDataLoader(...)")
    streamed = isinstance(task.train_data, IterableDataset)
    if streamed and task.schedule_on == "epoch":
        raise UsageError("--task", spec, "schedule_on='step' or 'eval:METRIC' with an iterable train_data",
                         "ranks' passes over a stream may end a batch apart; schedule per step instead")
    for name in ("train_data", "eval_data", "test_data"):
        data = getattr(task, name)
        if name == "train_data" and (streamed or data is None):
            continue
        if data is not None and not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise UsageError("--task", spec, f"Task.{name} to be a map-style Dataset "
                             f"(__getitem__ and __len__){' or an IterableDataset' if name == 'train_data' else ''}, "
                             f"got {type(data).__name__}", "wrap tensors in torch.utils.data.TensorDataset")
    if task.loss_fn is not None and task.step_fn is not None:
        raise UsageError("--task", spec, "Task.loss_fn or Task.step_fn, not both",
                         "keep step_fn(model, batch) and compute the loss inside it")
    for name in ("loss_fn", "step_fn"):
        if getattr(task, name) is not None and not callable(getattr(task, name)):
            raise UsageError("--task", spec, f"Task.{name} to be callable, got {type(getattr(task, name)).__name__}",
                             "e.g. loss_fn=torch.nn.functional.cross_entropy, or step_fn=my_step")
    if task.train_data is not None and not streamed and len(task.train_data) == 0:  # type: ignore[arg-type]  # map-style: Dataset's stubs lack __len__
        raise UsageError("--task", spec, "a non-empty Task.train_data", "check the dataset's path and size")
    if task.eval_data is not None and len(task.eval_data) == 0:  # type: ignore[arg-type]  # torch's Dataset declares no __len__; a map-style one has it
        raise UsageError("--task", spec, "a non-empty Task.eval_data, or None",
                         "give the held-out set items, or leave eval_data and metric out")
    for name in ("metric", "eval_fn", "make_optimizer", "make_scheduler", "finalize_metrics", "count_loss_items"):
        if getattr(task, name) is not None and not callable(getattr(task, name)):
            raise UsageError("--task", spec, f"Task.{name} to be callable or None, "
                             f"got {type(getattr(task, name)).__name__}", "pass a function, or leave it out")
    if task.metric is not None and task.eval_fn is not None:
        raise UsageError("--task", spec, "Task.metric or Task.eval_fn, not both",
                         "eval_fn(model, batch) computes the metric from the batch itself")
    if task.eval_data is None and (task.metric is not None or task.eval_fn is not None):
        raise UsageError("--task", spec, "Task.eval_data with Task.metric (or eval_fn)",
                         "a metric needs held-out data to run on")
    if task.eval_data is not None and task.metric is None and task.eval_fn is None and task.step_fn is not None:
        raise UsageError("--task", spec, "Task.metric (or eval_fn) with Task.eval_data and a Task.step_fn",
                         "without one, eval_data is scored by its loss (loss_fn, or the model's own .loss), which a "
                         "step_fn cannot give without changing the task's state")
    units = task.shard_units
    if units is not None and not callable(units) and not (
            isinstance(units, tuple) and units
            and all(isinstance(c, type) and issubclass(c, nn.Module) for c in units)):
        raise UsageError("--task", spec, f"Task.shard_units to be module classes (a tuple) or a function of the "
                         f"model, got {units!r}", "e.g. shard_units=(nn.TransformerEncoderLayer,)")
    if isinstance(task.tokens_per_sample, bool) or not isinstance(task.tokens_per_sample, int) \
            or task.tokens_per_sample < 0:
        raise UsageError("--task", spec,
                         f"Task.tokens_per_sample to be an integer >= 0, got {task.tokens_per_sample!r}",
                         "e.g. tokens_per_sample=1024 for sequences of 1024 tokens; 0 for no tokens")
    for name in ("default_lr", "default_clip_grad_norm"):
        value = getattr(task, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise UsageError("--task", spec, f"Task.{name} to be a number >= 0, got {value!r}",
                             "e.g. default_lr=1e-3; 0 turns clipping off")
    return task


PLUGIN_FACTORY = "make_task"  # the conventional factory name, which names no task


def task_label(spec: str) -> str:
    """A short name for the task `spec` names: the built-in name, the plugin's factory
    (`myplugin:good` -> `good`), or, where that is the conventional `make_task`, the
    plugin's module (`examples.plugin_task:make_task` -> `plugin_task`)."""
    if spec in BUILTIN_TASKS:
        return spec
    module_name, _, function_name = spec.partition(":")
    if function_name and function_name != PLUGIN_FACTORY:
        return function_name
    return module_name.rpartition(".")[2] or spec


def load_task(spec: str, config: TrainConfig) -> Task:
    """Build the task named by `spec` (a built-in name or 'module:function')."""
    target = BUILTIN_TASKS.get(spec, spec)
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise UsageError("--task", spec, "a built-in task (" + ", ".join(sorted(BUILTIN_TASKS))
                         + ") or 'package.module:function'", "e.g. --task examples.plugin_task:make_task")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError("--task", spec, f"an importable module {module_name!r} ({error})",
                         "check the name and that its folder is on PYTHONPATH") from error
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise UsageError("--task", spec, f"a function {function_name!r} in module {module_name!r}",
                         "check the name after the colon")
    task = _check_task(spec, factory(config))
    if (config.data or config.eval_data) and not task.data_identity:
        flag, given = ("--data", config.data[0]) if config.data else ("--eval-data", config.eval_data[0])
        raise UsageError(flag, given, f"a task that reads it (causal_lm, or a plugin that sets "
                         f"Task.data_identity); --task {spec} does not", f"drop {flag}, or use --task causal_lm")
    if not task.name:
        task.name = task_label(spec)
    return task
