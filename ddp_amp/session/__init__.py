"""The run core: `Session`, for a training loop you write yourself and for the Trainer's.

- `core`: `Session` (launcher, process group, precision, scaler, `parallelize` and unwrapping,
  the AMP step, the failure watch, teardown);
- `models`: wrapping and unwrapping the user's models.

Checkpoints are the session's `Checkpointer` (`ddp_amp.checkpoint`); its types are
re-exported here for a loop that saves and reads them.

Imports every layer below it; the Trainer builds on it.
"""

from ddp_amp.checkpoint import BestRecord, Checkpointer, Meta, Saved, SavedState
from ddp_amp.parallel import ShardOptions
from ddp_amp.session.core import Session

__all__ = ["BestRecord", "Checkpointer", "Meta", "Saved", "SavedState", "Session", "ShardOptions"]
