"""The run core: `Session`, for a training loop you write yourself and for the Trainer's.

- `core`: `Session` (launcher, process group, precision, scaler, `parallelize` and unwrapping,
  the AMP step, the failure watch, teardown);
- `models`: wrapping and unwrapping the user's models;
- `same_start`: rank 0's weights on every rank before a model is sharded;
- `saving`: its checkpoint methods, the session's `Checkpointer`'s (`ddp_amp.checkpoint`);
- `arrival`: `save` is collective: every rank arrives, or the ones that did say so in seconds;
- `preemption`: the Trainer's preemption stop for a loop of one's own (`Session.preemption`).

A loop over the session (the Trainer's, or a user's) reaches the layers below only through
it: the types its answers come in (the scaler, the autocast wrapper, the launch context,
checkpoint records) are re-exported here.

Imports every layer below it; the Trainer builds on it.
"""

from ddp_amp.amp import AgreedGradScaler, AutocastModule
from ddp_amp.checkpoint import BestRecord, Checkpointer, Meta, Saved, SavedState
from ddp_amp.distributed import DistContext, Liveness
from ddp_amp.env import DistEnv
from ddp_amp.parallel import ShardOptions
from ddp_amp.session.core import Session

__all__ = ["AgreedGradScaler", "AutocastModule", "BestRecord", "Checkpointer", "DistContext", "DistEnv", "Liveness",
           "Meta", "Saved", "SavedState", "Session", "ShardOptions"]
