"""Where a session's process is: its launch context, rank, world size and device.

`Session` takes these from `SessionPlace`; each reads the context the session started with
and refuses, in one line, a session not started.
"""

from __future__ import annotations

import torch

from ddp_amp.distributed import DistContext
from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError


class SessionPlace:
    """This process's place in the job, once the session started."""

    _ctx: DistContext | None = None

    @property
    def ctx(self) -> DistContext:
        if self._ctx is None:
            raise UsageError("Session", "not started", "a started session",
                             "use it inside `with Session(...) as session:`")
        return self._ctx

    @property
    def env(self) -> DistEnv:
        return self.ctx.env

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def local_rank(self) -> int:
        return self.ctx.env.local_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def device(self) -> torch.device:
        return self.ctx.device
