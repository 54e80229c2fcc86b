"""Option values that are written as text and used as typed values: parsed once, at the edge.

`--preempt-signal USR1,TERM`, `--profile-steps 10:12`, `--keep-best eval_accuracy:max`,
`--tracker tensorboard,wandb` and `--allow-change seed,task_opt` arrive as text from a flag,
a `--config` file or a `TrainConfig` built in code. Each kind here turns that text into the
value the code uses (`parse`), refusing bad text with a one-line `UsageError`, and back into
the text a flag would take (`text`), which is what `config.json` records and `--print-config`
writes. Nothing else in ddp_amp parses these strings.

Each component declares its options with `option()` in a small frozen dataclass of its own
(`PrecisionOptions` in `amp`, `CheckpointOptions` in `checkpoint`, ...): the field's help
is its `--help` text, and `typed_fields` and `check_fields` are the checks every option gets
(text to value, choices, numeric range), whichever component holds it.

Standard library only: the configuration is checked before torch is imported.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

from ddp_amp.errors import UsageError

_SIGNAL_NAMES = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT")
_METRIC_GOAL = re.compile(r"^([A-Za-z_][\w.-]*)(?::(min|max))?$")
_STEP_WINDOW = re.compile(r"^([0-9]+):([0-9]+)$")


class MetricGoal(NamedTuple):
    """`--keep-best METRIC[:min|max]`: the eval metric to keep the best checkpoint by."""

    metric: str
    mode: str  # "min" or "max"


class StepWindow(NamedTuple):
    """`--profile-steps A:B`: optimizer steps A to B, both included, counted from 1."""

    first: int
    last: int


def parse_signals(text: str, flag: str) -> tuple[signal.Signals, ...]:
    """'USR1,TERM' (or 'SIGUSR1,sigterm') -> the signals, each once; 'none' or '' -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    found: list[signal.Signals] = []
    for raw in text.split(","):
        name = raw.strip().upper().removeprefix("SIG")
        if name not in _SIGNAL_NAMES:
            raise UsageError(flag, raw.strip(), "a comma list of " + ", ".join(_SIGNAL_NAMES) + ", or none",
                             "SLURM's --signal=USR1@120 needs USR1")
        found.append(signal.Signals[f"SIG{name}"])
    return tuple(dict.fromkeys(found))


def signals_text(signals: tuple[signal.Signals, ...]) -> str:
    return ",".join(s.name.removeprefix("SIG") for s in signals) or "none"


def parse_metric_goal(text: str, flag: str) -> MetricGoal | None:
    """'eval_nll' -> MetricGoal('eval_nll', 'min'); 'eval_accuracy:max'; '' -> None."""
    if not text:
        return None
    match = _METRIC_GOAL.match(text)
    if match is None:
        raise UsageError(flag, text, "METRIC or METRIC:min or METRIC:max",
                         "e.g. --keep-best eval_nll, or --keep-best eval_accuracy:max")
    return MetricGoal(match[1], match[2] or "min")


def parse_step_window(text: str, flag: str) -> StepWindow | None:
    """'10:12' -> StepWindow(10, 12); '' -> None."""
    if not text:
        return None
    match = _STEP_WINDOW.match(text)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise UsageError(flag, text, "A:B with 1 <= A <= B (optimizer steps)",
                         "e.g. --profile-steps 10:12 to profile three steps after warm-up")
    return StepWindow(int(match[1]), int(match[2]))


def parse_names(text: str, flag: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): a comma list, blanks dropped, each name once."""
    return tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


def parse_field_names(text: str, flag: str) -> tuple[str, ...]:
    """'--task-opt, seed' -> ('task_opt', 'seed'): options named as flags or as fields."""
    return tuple(name.removeprefix("--").replace("-", "_") for name in parse_names(text, flag))


@dataclass(frozen=True)
class TextKind:
    """How one option's text becomes its value and back."""

    parse: Any  # (text, flag) -> value
    text: Any  # value -> text


def _goal_text(goal: MetricGoal | None) -> str:
    if goal is None:
        return ""
    return goal.metric if goal.mode == "min" else f"{goal.metric}:{goal.mode}"  # min is the default


def _window_text(window: StepWindow | None) -> str:
    return f"{window.first}:{window.last}" if window else ""


SIGNALS = TextKind(parse_signals, signals_text)
METRIC_GOAL = TextKind(parse_metric_goal, _goal_text)
STEP_WINDOW = TextKind(parse_step_window, _window_text)
NAMES = TextKind(parse_names, ",".join)
FIELD_NAMES = TextKind(parse_field_names, ",".join)


# ---- options as dataclass fields ------------------------------------------------------------

# Upper bounds keep values inside what the code can represent (2**53: exact in JSON and
# floats; timeouts inside a timedelta).
INT_LIMIT = 2**53
TEN_YEARS_S = 10 * 365 * 86400.0


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, resume: str = "notice",
           kind: TextKind | None = None, launch: bool = False, limits: tuple[float, float] | None = None,
           bare: str | None = None) -> Any:
    """A field: `help` is its --help text, `kind` turns its text into its typed value,
    `launch` marks an option about this launch rather than the run (left out of --print-config),
    `limits` is a numeric option's inclusive range (zero, where allowed, means what `help` says),
    `bare` the value of the flag given without one (an option that was a switch and grew
    choices: `--flag` alone keeps its meaning, `--no-flag` gives the default; a config file
    may still write it as a boolean).

    `resume` says what a resume does where the option differs from the value the checkpoint
    was saved with: "match" refuses (unless named in --allow-change), "notice" applies the new
    value and says so, "precision" follows the AMP recipe's rules (a fresh or ignored scaler,
    with a notice), "free" is about this launch only and is not compared.
    """
    return field(default=default, metadata={"help": help, "choices": choices, "resume": resume, "kind": kind,
                                            "launch": launch, "limits": limits, "bare": bare})


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def typed_fields(options: Any) -> None:
    """Hold each option of the frozen dataclass `options` as its value: text of a text kind
    is parsed, a value given in code goes through its text too (so it is checked alike),
    and a list (from code or JSON) becomes the tuple a flag would give."""
    for f in dataclasses.fields(options):
        kind, value = f.metadata["kind"], getattr(options, f.name)
        if isinstance(value, list):
            value = tuple(value)
        if kind is not None:
            value = kind.parse(value if isinstance(value, str) else kind.text(value), flag_of(f.name))
        object.__setattr__(options, f.name, value)


def check_fields(options: Any, owner: type) -> None:
    """Raise a one-line UsageError where an option `owner` declares is not one of its
    choices or outside its range."""
    for f in dataclasses.fields(owner):
        value, choices, limits = getattr(options, f.name), f.metadata["choices"], f.metadata["limits"]
        if choices and value not in choices:
            raise UsageError(flag_of(f.name), value, "one of " + ", ".join(choices), f"see {flag_of(f.name)} in --help")
        if limits is not None:
            check_number(flag_of(f.name), value, *limits)


def check_number(flag: str, value: float, low: float, high: float) -> None:
    """Raise a one-line UsageError unless `low <= value <= high` (nan and inf never are)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(flag, value, f"a finite number from {low:g} to {high:g}", f"see {flag} in --help")
    if not low <= value <= high:
        kind = "an integer" if isinstance(value, int) else "a number"
        raise UsageError(flag, value, f"{kind} from {low:g} to {high:g}", f"see {flag} in --help")


_Options = TypeVar("_Options", bound="ComponentOptions")


class ComponentOptions:
    """The base of a component's frozen options dataclass: a component's own options are
    typed and checked when it is built, and `of` picks them out of a run's configuration
    (which holds every component's fields), so a component never sees the whole of it."""

    # What @dataclass gives each subclass; declared (never set) here, so that type checkers
    # take a ComponentOptions for the dataclass it always is.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        typed_fields(self)
        self.check()

    def check(self) -> None:
        """Raise a one-line UsageError for a bad value. Each component says which fields it
        checks (`check_fields(self, ItsOptions)`), as a run's configuration calls it on itself."""
        raise NotImplementedError(f"{type(self).__name__}.check")

    @classmethod
    def of(cls: type[_Options], options: Any) -> _Options:
        """This component's options, picked by name from `options` (a run's configuration)."""
        values = {f.name: getattr(options, f.name) for f in dataclasses.fields(cls)}
        return cls(**values)
