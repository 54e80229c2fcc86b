"""The run's configuration: one frozen dataclass whose field help doubles as `--help`.

Each field's `help` metadata is its docstring; `choices` metadata limits its values;
`resume` metadata says what a resume does when it differs. Validation of values and of
option combinations happens in the dataclass itself, so a config built in code, from flags
or from a `--config` file (`command_line.py`) is checked alike.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from dataclasses import dataclass, field
from typing import Any

from ddp_amp.amp import PRECISION_CHOICES, LossScaleOptions
from ddp_amp.errors import UsageError
from ddp_amp.option_values import (FIELD_NAMES, METRIC_GOAL, NAMES, SIGNALS, STEP_WINDOW, MetricGoal, StepWindow,
                                   TextKind)


# What a resume does when a field differs from the value the checkpoint was saved with:
# "match" refuses (unless named in --allow-change), "notice" applies the new value and says
# so, "precision" follows the AMP recipe's rules (a fresh or ignored scaler, with a notice),
# "free" is about this launch only and is not compared.
RESUME_CLASSES = ("match", "notice", "precision", "free")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, resume: str = "notice",
         kind: TextKind | None = None, launch: bool = False) -> Any:
    """A field: `help` is its --help text, `kind` turns its text into its typed value,
    `launch` marks an option about this launch rather than the run (left out of --print-config)."""
    return field(default=default, metadata={"help": help, "choices": choices, "resume": resume, "kind": kind,
                                            "launch": launch})


@dataclass(frozen=True)
class TrainConfig:
    """Everything `python -m ddp_amp.train` can be told. Field help is the `--help` text.

    Options written as text (signals, step windows, metric goals, name lists) may be given
    as that text or as their value; they hold their value once built (`option_values`).
    """

    task: str = _opt("lm", "built-in task: lm (transformer LM on Python's own docs), digits "
                     "(scikit-learn digits, needs ddp_amp[sklearn]), mlp (synthetic benchmark); "
                     "or a plugin 'package.module:function' that takes this config and returns a ddp_amp.Task",
                     resume="match")
    task_opt: tuple[str, ...] = _opt((), "task option KEY=VALUE, repeatable; read by the task "
                                     "(e.g. --task-opt hidden=256)", resume="match")
    run_dir: str = _opt("", "directory for config, metrics, checkpoints and the summary; default "
                        "runs/<task>-<id>: the SLURM job id, else torchrun's rendezvous id where it "
                        "names this run, else a new name; restarts and requeues of a job find it again",
                        resume="free", launch=True)
    run_name: str = _opt("", "name the run: its directory is runs/<name> (instead of --run-dir)",
                         resume="free", launch=True)
    max_steps: int = _opt(200, "optimizer steps to run (skipped fp16 steps count as steps)")
    batch_size: int = _opt(64, "global batch size per optimizer step, summed over ranks and "
                           "accumulation micro-steps; must divide by world size x --grad-accum",
                           resume="match")
    grad_accum: int = _opt(1, "micro-steps accumulated per optimizer step (DDP syncs only on the last)",
                           resume="match")
    lr: float = _opt(0.0, "learning rate; 0 means the task's own default. A resume with another "
                     "value scales the optimizer's (and scheduler's) learning rates to it")
    optimizer: str = _opt("auto", "optimizer: auto (the task's own, else AdamW), adamw, sgd",
                          ("auto", "adamw", "sgd"), resume="match")
    clip_grad_norm: float = _opt(0.0, "clip the global grad norm to this after unscaling; 0 = the "
                                 "task's default (lm: 0.5, others: off)")
    seed: int = _opt(0, "seed for model init (same on all ranks) and data order; rank r "
                     "seeds its own RNGs with seed + r after the model is built", resume="match")
    precision: str = _opt("auto", "auto (bf16 on GPUs/CPUs with bf16 units, else fp16 on GPUs, "
                          "else fp32), fp32, bf16, fp16 (with loss scaling), or fp8 (bf16 plus float8 "
                          "linear layers on Ada/Hopper GPUs; needs ddp_amp[fp8])", PRECISION_CHOICES,
                          resume="precision")
    fp8_emulate: bool = _opt(False, "with --precision fp8: emulate the float8 matmuls, so fp8 runs on "
                             "any device (slow; for tests)")
    device: str = _opt("auto", "auto (cuda if available), cuda (GPU of the local rank), or cpu",
                       ("auto", "cuda", "cpu"))
    backend: str = _opt("auto", "process-group backend: auto (nccl on cuda, gloo on cpu; no group "
                        "for one process), nccl, gloo (needed for several ranks on one GPU); "
                        "naming one forms a group even for one process, so DDP runs", ("auto", "nccl", "gloo"))
    dist_timeout: float = _opt(600.0, "seconds a collective may wait for a peer before the "
                               "job fails instead of hanging")
    num_workers: int = _opt(0, "DataLoader worker processes per rank")
    log_every: int = _opt(20, "print and record metrics every N optimizer steps")
    tracker: tuple[str, ...] = _opt((), "experiment trackers that also get every record, comma-separated: "
                                    "tensorboard, wandb (offline unless WANDB_MODE says otherwise), mlflow, or "
                                    "package.module:function returning your own; rank 0 only; a resume continues "
                                    "their runs", resume="free", kind=NAMES)
    debug: bool = _opt(False, "show full tracebacks on errors", resume="free", launch=True)
    profile_steps: StepWindow | None = _opt(None, "A:B: record torch.profiler over optimizer steps A to B on "
                                            "every rank into <run-dir>/profile/ (TensorBoard and Perfetto open it); "
                                            "rank 0 prints the top ops per step", resume="free", kind=STEP_WINDOW)
    peak_tflops: float = _opt(0.0, "the device's dense peak TFLOP/s for the run's precision, for the log's MFU "
                              "(0: from the table of known GPUs, docs/peaks.md; a GPU not in it, or a CPU, gets no "
                              "MFU)", resume="free")
    memory_snapshot: bool = _opt(False, "CUDA only: record the allocator's history and write a memory snapshot "
                                 "to <run-dir>/profile/ at the end of the profile window or training, and on "
                                 "out-of-memory", resume="free")
    # --- checkpoints (ddp_amp/checkpoint/) ---
    ckpt_every: int = _opt(0, "also save a checkpoint every N optimizer steps; 0 = only the "
                           "final one at the end of training")
    keep_last: int = _opt(3, "keep the newest K checkpoints; older ones are deleted only after "
                          "a new one is committed; 0 keeps all")
    resume: str = _opt("auto", "auto (newest complete checkpoint in <run-dir>/checkpoints, if "
                       "any), none (a fresh run: refused where checkpoints exist, unless "
                       "--archive-checkpoints), or PATH of a checkpoint directory", resume="free", launch=True)
    keep_best: MetricGoal | None = _opt(None, "METRIC[:min|max]: also keep the checkpoint with the best value "
                                        "of an eval metric (e.g. eval_nll, or eval_accuracy:max; min by default), "
                                        "saved at the evaluation that finds it; retention never deletes it; the "
                                        "task's test data, if any, is scored with it at the end", kind=METRIC_GOAL)
    archive_checkpoints: bool = _opt(False, "with --resume none: move the run directory's checkpoints "
                                     "to checkpoints-archived-<time>/ before the first step", resume="free",
                                     launch=True)
    async_checkpoint: bool = _opt(False, "write the --ckpt-every checkpoints in the background: training "
                                  "waits only for a host copy of the state, rank 0 writes it while the next "
                                  "steps run (one save in flight; the final, preemption and --keep-best saves "
                                  "stay synchronous)", resume="free")
    allow_change: tuple[str, ...] = _opt((), "comma list of settings that must match on resume (marked so in "
                                         "this help) whose change you accept, e.g. seed,task_opt", resume="free",
                                         kind=FIELD_NAMES, launch=True)
    # --- watching a run (ddp_amp/guards/): fp16 loss-scale safety and the rank-consistency guard ---
    loss_scale_init: float = _opt(65536.0, "fp16: the loss scale to start from")
    loss_scale_growth_interval: int = _opt(2000, "fp16: clean steps in a row before the scale doubles")
    loss_scale_backoff: float = _opt(0.5, "fp16: factor the scale is multiplied by on overflow (0 < f < 1)")
    loss_scale_min: float = _opt(1.0, "fp16: floor the scale never backs off below; overflows at the "
                                 "floor stop the run (0 = no floor)")
    loss_scale_hysteresis: int = _opt(1, "fp16: consecutive overflowing steps tolerated before the "
                                      "scale backs off (DeepSpeed's hysteresis); they are still skipped")
    max_consecutive_skips: int = _opt(100, "fp16: stop with an error after this many skipped steps "
                                      "in a row (0 = never)")
    check_sync_every: int = _opt(0, "every N steps compare a fingerprint of parameters, scaler state "
                                 "and step across ranks and stop if they differ (0 = only after a resume)")
    # --- preemption (ddp_amp/guards/preemption.py): signal -> agreed stop -> checkpoint -> requeue ---
    preempt_signal: tuple[signal.Signals, ...] = _opt(
        (signal.SIGUSR1,), "signals that mean 'checkpoint at the next agreed step, then requeue' (exit 75): what "
        "SLURM sends before a time limit with --signal=B:USR1@<s>. Comma list of USR1, USR2, TERM, INT, HUP, QUIT, "
        "or none", kind=SIGNALS)
    stop_signal: tuple[signal.Signals, ...] = _opt(
        (signal.SIGTERM,), "signals that mean 'checkpoint if possible, then exit without a requeue' (exit 128 + "
        "the signal): scancel sends TERM, so a cancelled job stays cancelled. Same list as --preempt-signal, none "
        "of the same signals", kind=SIGNALS)
    preempt_check_s: float = _opt(2.0, "seconds of training between the cross-rank checks of the "
                                  "preemption flag (each check is one tiny all-reduce)")
    max_requeues: int = _opt(20, "requeue a preempted SLURM job at most this many times (its "
                             "SLURM_RESTART_COUNT); then stop with the checkpoint and say so. 0 never requeues")
    preempt_requeue: str = _opt("auto", "after a preemption stop: auto (rank 0 runs `scontrol "
                                "requeue $SLURM_JOB_ID` under SLURM) or never", ("auto", "never"))

    # --- sharding (ddp_amp/parallel/fsdp.py): models larger than one GPU ---
    shard: bool = _opt(False, "shard the model, its gradients and the optimizer state over the ranks (FSDP2) "
                       "instead of replicating them (DDP): each rank holds 1/N; the task's blocks "
                       "(Task.shard_units) are the units; checkpoints are written sharded (each rank its part)")
    reshard_after_forward: bool = _opt(True, "with --shard: free each unit's gathered weights after its forward "
                                       "and gather them again for backward (--no-reshard-after-forward keeps them, "
                                       "more memory, less communication)")
    activation_checkpointing: bool = _opt(False, "with --shard: recompute each unit's activations in backward "
                                          "instead of keeping them (less memory, one more forward per unit)")
    # --- performance fast paths (measured by python -m ddp_amp.bench) ---
    compile: bool = _opt(False, "torch.compile the model (inside the autocast wrapper, under DDP) and "
                         "the loss; the first steps pay the compile time. Pays on transformers, not on "
                         "steps too short to be GPU-bound (docs/benchmarks.md has the figures)")
    grad_comm_dtype: str = _opt("fp32", "dtype gradients are reduced in (DDP's all-reduce, --shard's "
                                "reduce-scatter): fp32, or bf16/fp16 (half the traffic, less precise sums)",
                                ("fp32", "bf16", "fp16"))
    static_graph: bool = _opt(False, "tell DDP the graph is the same every step (same parameters "
                              "used, no data-dependent control flow); lets it skip per-step work")
    optimizer_impl: str = _opt("auto", "optimizer kernels for adamw/sgd: auto (fused where "
                               "available, else foreach), fused, foreach, forloop",
                               ("auto", "fused", "foreach", "forloop"))
    # --- evaluation (the task's held-out data and metric) ---
    eval_every: int = _opt(50, "run the task's metric on its held-out data before the first step "
                           "and every N optimizer steps (all ranks, under autocast); 0 = only "
                           "once, at the end, for the summary")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # text in, typed value held: parsed here and only here
            kind, value = f.metadata["kind"], getattr(self, f.name)
            if isinstance(value, list):  # a list from code or JSON: the tuple a flag would give
                value = tuple(value)
            if kind is not None:  # a value given in code goes through its text too, so it is checked alike
                value = kind.parse(value if isinstance(value, str) else kind.text(value), flag_of(f.name))
            object.__setattr__(self, f.name, value)
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise UsageError(flag_of(f.name), getattr(self, f.name), "one of " + ", ".join(choices),
                                 f"see {flag_of(f.name)} in --help")
        for name, (low, high) in NUMBER_LIMITS.items():
            check_number(flag_of(name), getattr(self, name), low, high)
        self.loss_scale_options()  # the loss-scale rules are the amp layer's own
        for item in self.task_opt:
            if "=" not in item:
                raise UsageError("--task-opt", item, "KEY=VALUE", "e.g. --task-opt hidden=256")
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.run_dir and self.run_name:
            raise UsageError("--run-name", self.run_name, "either --run-dir or --run-name, not both",
                             "--run-name NAME is short for --run-dir runs/NAME")
        if self.run_name in (".", "..") or "/" in self.run_name or "\\" in self.run_name:
            raise UsageError("--run-name", self.run_name, "a plain name (no path separators)",
                             "use --run-dir for a path")
        both = sorted(s.name for s in set(self.preempt_signal) & set(self.stop_signal))
        if both:
            raise UsageError("--stop-signal", text_of(self, "stop_signal"), "signals not also in --preempt-signal",
                             f"{', '.join(both)} cannot mean both requeue and stop; drop it from one")
        if self.async_checkpoint and not self.ckpt_every:
            raise UsageError("--async-checkpoint", True, "--ckpt-every N with it (the saves it moves to the background)",
                             "the final checkpoint is always written before the run ends; add e.g. --ckpt-every 500")
        if self.shard:
            for name in ("compile", "static_graph"):
                if getattr(self, name):
                    raise UsageError(flag_of(name), True, "an option that works with --shard",
                                     f"{flag_of(name)} is not supported with --shard yet; drop one of them")
        elif not self.reshard_after_forward or self.activation_checkpointing:
            name = "activation_checkpointing" if self.activation_checkpointing else "reshard_after_forward"
            raise UsageError(flag_of(name), getattr(self, name), "--shard with it (it is a sharding option)",
                             "add --shard, or drop it")
        if self.archive_checkpoints and self.resume != "none":
            raise UsageError("--archive-checkpoints", True, "--resume none with it",
                             "it moves old checkpoints aside for a fresh run: add --resume none")
        must_match = match_fields()
        for name in self.allow_change:
            if name not in must_match:
                raise UsageError("--allow-change", name, "names of settings that must match on resume: "
                                 + ", ".join(must_match), "other settings may change without it")

    def loss_scale_options(self) -> LossScaleOptions:
        """The `--loss-scale-*` settings as the amp layer takes them, checked there."""
        options = LossScaleOptions(self.loss_scale_init, self.loss_scale_growth_interval, self.loss_scale_backoff,
                                   self.loss_scale_min, self.loss_scale_hysteresis, self.max_consecutive_skips)
        options.validate()
        return options

    def task_options(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.task_opt)

    def micro_batch_size(self, world_size: int) -> int:
        """Per-rank batch of one micro-step; raises if the global batch does not divide."""
        parts = world_size * self.grad_accum
        if self.batch_size % parts:
            raise UsageError("--batch-size", self.batch_size,
                             f"a multiple of world size x --grad-accum = {world_size} x "
                             f"{self.grad_accum} = {parts}",
                             f"try --batch-size {max(parts, self.batch_size // parts * parts)}")
        return self.batch_size // parts

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
    if kind is not None and isinstance(saved, str) and isinstance(now, str):
        try:
            return kind.parse(saved, flag_of(name)) == kind.parse(now, flag_of(name))
        except UsageError:  # a value an older version accepted: compare the text
            return saved == now
    return saved == now


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


# Every numeric option's range, inclusive. Zero, where allowed, means what the option's help
# says ("0 turns it off", "0 = only at the end"). The upper bounds keep values inside what
# the code can represent (2**53: exact in JSON and floats; timeouts inside a timedelta).
INT_LIMIT = 2**53
TEN_YEARS_S = 10 * 365 * 86400.0
NUMBER_LIMITS: dict[str, tuple[float, float]] = {
    "max_steps": (1, INT_LIMIT), "batch_size": (1, 2**31), "grad_accum": (1, 2**31), "lr": (0, 1e6),
    "clip_grad_norm": (0, 1e12), "seed": (0, 2**63 - 1), "dist_timeout": (1e-3, TEN_YEARS_S),
    "num_workers": (0, 256), "log_every": (1, INT_LIMIT), "ckpt_every": (0, INT_LIMIT),
    "keep_last": (0, 2**31), "max_consecutive_skips": (0, INT_LIMIT), "check_sync_every": (0, INT_LIMIT),
    "preempt_check_s": (1e-12, TEN_YEARS_S), "eval_every": (0, INT_LIMIT), "max_requeues": (0, 10**6),
    "peak_tflops": (0, 1e7),
}


def check_number(flag: str, value: float, low: float, high: float) -> None:
    """Raise a one-line UsageError unless `low <= value <= high` (nan and inf never are)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(flag, value, f"a finite number from {low:g} to {high:g}", f"see {flag} in --help")
    if not low <= value <= high:
        kind = "an integer" if isinstance(value, int) else "a number"
        raise UsageError(flag, value, f"{kind} from {low:g} to {high:g}", f"see {flag} in --help")


def match_fields() -> tuple[str, ...]:
    """The settings a resume refuses to change (unless accepted with --allow-change)."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["resume"] == "match")
