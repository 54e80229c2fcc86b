"""Checkpoints that survive crashes: commit protocol, discovery, safe loading, agreement.

    from ddp_amp.checkpoint import save_directory, read_agreed, newest_complete

- `commit`: a directory appears whole or not at all (temporary directory, fsync, manifest,
  rename); retention deletes old checkpoints only after a new one is committed;
- `manifest`: sizes and sha256 of every file, so a torn checkpoint is told from a whole one;
- `best`: the pointer to the best checkpoint by an eval metric, which retention keeps;
- `discovery`: `step-N` layout, the newest complete checkpoint, `--resume auto|none|PATH`;
- `safe_types`: what a checkpoint may hold and the restricted loader that reads it back;
- `rng`: every rank's RNG states;
- `save` / `load`: the collective save and load that the Trainer and `Session` both use;
- `background` / `staging`: the same save with the write in a thread on rank 0, from a host
  copy of the state (`--async-checkpoint`);
- `sharded`: a checkpoint whose sharded state each rank writes its part of (FSDP2, with
  torch.distributed.checkpoint), committed by rank 0 once every part is whole.

What goes into the files is the caller's: the Trainer saves its model and training state,
`Session` the user's state. Imports `amp`, `distributed`, `durable`, `errors` and `version`.
"""

from ddp_amp.checkpoint.background import BackgroundSaver, FinishedWrite
from ddp_amp.checkpoint.best import BEST_FILE, BestRecord, read_best, write_best
from ddp_amp.checkpoint.commit import apply_retention, commit_checkpoint, commit_directory
from ddp_amp.checkpoint.discovery import (checkpoint_root, complete_copy, list_step_dirs, newest_complete,
                                          resolve_resume, step_dir_name, step_of)
from ddp_amp.checkpoint.load import (LoadedCheckpoint, choose_checkpoint, read_agreed, read_checkpoint,
                                     restore_own_rng, restore_scaler)
from ddp_amp.checkpoint.manifest import IncompleteCheckpoint, verify_checkpoint
from ddp_amp.checkpoint.rng import capture_rng, gather_rng_states, restore_rng
from ddp_amp.checkpoint.safe_types import check_loadable, safe_load
from ddp_amp.checkpoint.save import META_FILE, RNG_FILE, CheckpointError, SaveResult, ensure_writable, save_directory
from ddp_amp.checkpoint.sharded import SHARDED_DIR, load_sharded, save_sharded, sharded_shapes, sharded_tensors

__all__ = [
    "BEST_FILE", "META_FILE", "RNG_FILE", "SHARDED_DIR", "load_sharded", "save_sharded", "sharded_shapes",
    "sharded_tensors", "BackgroundSaver", "BestRecord", "CheckpointError", "FinishedWrite",
    "IncompleteCheckpoint", "LoadedCheckpoint", "SaveResult", "read_best", "write_best",
    "apply_retention", "capture_rng", "check_loadable", "checkpoint_root", "choose_checkpoint",
    "commit_checkpoint", "commit_directory", "complete_copy", "ensure_writable", "gather_rng_states",
    "list_step_dirs", "newest_complete", "read_agreed", "read_checkpoint", "resolve_resume",
    "restore_own_rng", "restore_rng", "restore_scaler", "safe_load", "save_directory",
    "step_dir_name", "step_of", "verify_checkpoint",
]
