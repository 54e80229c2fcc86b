"""Option values that are written as text and used as typed values: parsed once, at the edge.

`--preempt-signal USR1,TERM`, `--profile-steps 10:12`, `--keep-best eval_accuracy:max`,
`--tracker tensorboard,wandb` and `--allow-change seed,task_opt` arrive as text from a flag,
a `--config` file or a `TrainConfig` built in code. Each kind here turns that text into the
value the code uses (`parse`), refusing bad text with a one-line `UsageError`, and back into
the text a flag would take (`text`), which is what `config.json` records and `--print-config`
writes. Nothing else in ddp_amp parses these strings.

Standard library only: the configuration is checked before torch is imported.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any, NamedTuple

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
