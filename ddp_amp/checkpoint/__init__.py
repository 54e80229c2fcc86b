"""Checkpoints that survive crashes: commit protocol, discovery, contents, safe loading.

    from ddp_amp.checkpoint import save_checkpoint, load_checkpoint, newest_complete

The trainer uses `Trainer.save_checkpoint()` / `Trainer.load_checkpoint(path)`; these
functions are the layer beneath, usable from a user's own loop.
"""

from ddp_amp.checkpoint.commit import commit_checkpoint
from ddp_amp.checkpoint.discovery import checkpoint_root, newest_complete, resolve_resume, step_dir_name
from ddp_amp.checkpoint.load import choose_checkpoint, load_checkpoint, safe_load
from ddp_amp.checkpoint.manifest import IncompleteCheckpoint, verify_checkpoint
from ddp_amp.checkpoint.save import CheckpointError, SaveResult, ensure_writable, save_checkpoint
from ddp_amp.checkpoint.state import TrainingParts, describe_run

__all__ = [
    "CheckpointError",
    "IncompleteCheckpoint",
    "SaveResult",
    "TrainingParts",
    "checkpoint_root",
    "choose_checkpoint",
    "commit_checkpoint",
    "describe_run",
    "ensure_writable",
    "load_checkpoint",
    "newest_complete",
    "resolve_resume",
    "safe_load",
    "save_checkpoint",
    "step_dir_name",
    "verify_checkpoint",
]
