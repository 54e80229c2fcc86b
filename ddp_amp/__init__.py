"""ddp_amp: DistributedDataParallel + automatic mixed precision, on any launcher.

Each layer is usable from your own script:

    from ddp_amp import detect_env, init_distributed, resolve_precision, AutocastModule

or all of them behind one object for your own loop: `with ddp_amp.Session() as session:`.

The CLI (`python -m ddp_amp.train`) is built on the same public pieces.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ddp_amp import start_parent as _start_parent  # noqa: F401  # before anything slow: its first look at the parent
from ddp_amp.version import __version__

# Where each public name lives, imported on first use: `python -m ddp_amp.train` imports this
# package before its own first line, and it must get to hold the preemption signals before
# torch's import (seconds) can be interrupted by one (ddp_amp/startup_signals.py).
_PUBLIC = {
    "AgreedGradScaler": "ddp_amp.amp", "AutocastModule": "ddp_amp.amp", "Precision": "ddp_amp.amp",
    "StepResult": "ddp_amp.amp", "resolve_precision": "ddp_amp.amp", "unwrap_model": "ddp_amp.amp",
    "TrainConfig": "ddp_amp.config",
    "DistContext": "ddp_amp.distributed", "Liveness": "ddp_amp.distributed", "distributed": "ddp_amp.distributed",
    "init_distributed": "ddp_amp.distributed", "shutdown_distributed": "ddp_amp.distributed",
    "ShardOptions": "ddp_amp.parallel",
    "DistEnv": "ddp_amp.env", "detect_env": "ddp_amp.env",
    "UsageError": "ddp_amp.errors",
    "Session": "ddp_amp.session",
    "LoaderRequest": "ddp_amp.tasks", "Task": "ddp_amp.tasks", "load_task": "ddp_amp.tasks",
}

if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported (`X as X`: a re-export)
    from ddp_amp.amp import AgreedGradScaler as AgreedGradScaler
    from ddp_amp.amp import AutocastModule as AutocastModule
    from ddp_amp.amp import Precision as Precision
    from ddp_amp.amp import StepResult as StepResult
    from ddp_amp.amp import resolve_precision as resolve_precision
    from ddp_amp.amp import unwrap_model as unwrap_model
    from ddp_amp.config import TrainConfig as TrainConfig
    from ddp_amp.distributed import DistContext as DistContext
    from ddp_amp.distributed import Liveness as Liveness
    from ddp_amp.distributed import distributed as distributed
    from ddp_amp.distributed import init_distributed as init_distributed
    from ddp_amp.distributed import shutdown_distributed as shutdown_distributed
    from ddp_amp.parallel import ShardOptions as ShardOptions
    from ddp_amp.env import DistEnv as DistEnv
    from ddp_amp.env import detect_env as detect_env
    from ddp_amp.errors import UsageError as UsageError
    from ddp_amp.session import Session as Session
    from ddp_amp.tasks import LoaderRequest as LoaderRequest
    from ddp_amp.tasks import Task as Task
    from ddp_amp.tasks import load_task as load_task


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ddp_amp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["__version__", *_PUBLIC]
