"""ddp_amp: DistributedDataParallel + automatic mixed precision, on any launcher.

Each layer is usable from your own script:

    from ddp_amp import detect_env, init_distributed, resolve_precision, AutocastModule

or all of them behind one object for your own loop: `with ddp_amp.Session() as session:`.

The CLI (`python -m ddp_amp.train`) is built on the same public pieces.
"""

from ddp_amp.amp import (AgreedGradScaler, AutocastModule, Precision, StepResult, resolve_precision,
                         unwrap_model)
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistContext, distributed, init_distributed, shutdown_distributed
from ddp_amp.env import DistEnv, detect_env
from ddp_amp.errors import UsageError
from ddp_amp.session import Session
from ddp_amp.tasks import LoaderRequest, Task, load_task
from ddp_amp.version import __version__

__all__ = [
    "AgreedGradScaler",
    "AutocastModule",
    "DistContext",
    "DistEnv",
    "LoaderRequest",
    "Precision",
    "Session",
    "StepResult",
    "Task",
    "TrainConfig",
    "__version__",
    "UsageError",
    "detect_env",
    "distributed",
    "init_distributed",
    "load_task",
    "resolve_precision",
    "shutdown_distributed",
    "unwrap_model",
]
