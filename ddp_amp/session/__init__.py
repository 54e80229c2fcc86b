"""The run core: `Session`, for a training loop you write yourself and for the Trainer's.

- `core`: `Session` (launcher, process group, precision, scaler, `parallelize` and unwrapping,
  the AMP step, the failure watch, teardown);
- `checkpoints`: saving in the background or now, reading on every rank, restoring;
- `layout`: the one checkpoint layout, which `--resume` and `python -m ddp_amp.export` read.

Imports every layer below it; the Trainer builds on it.
"""

from ddp_amp.parallel import ShardOptions
from ddp_amp.session.checkpoints import Saved
from ddp_amp.session.core import Session
from ddp_amp.session.layout import SavedState

__all__ = ["Saved", "SavedState", "Session", "ShardOptions"]
