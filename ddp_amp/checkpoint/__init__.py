"""State on disk: one `Checkpointer` saves, finds, reads and restores every checkpoint.

    checkpointer = Checkpointer(ctx, precision, scaler, warn)   # a Session makes its own
    checkpointer.save(path, state, per_rank, meta, keep_last, background)  # collective
    checkpointer.latest(root); checkpointer.read(path, check); checkpointer.restore(saved, state, ...)

- `checkpointer`: `Checkpointer` and `Saved`, the one way in for the Trainer and `Session`;
- `layout`: the files of a checkpoint (a module per file, state.pt) and `SavedState`, one
  read back; `sharded_state`: the entries written as DCP shards;
- `meta`: `Meta`, meta.json as a typed record, read and written there only;
- `commit`: a directory appears whole or not at all (temporary directory, fsync, manifest,
  rename); `retention` lets old checkpoints go only after a new one is committed, each rank
  deleting its own files of them in the background;
- `manifest`: sizes and sha256 of rank 0's files and a digest over every rank's record, so a
  torn checkpoint is told from a whole one; `verify`: all of it in one process, or on resume
  each rank its share (what it reads), agreed through one exchange of fixed-size reports;
- `rank_files`: each rank's own files (its RNG file, its record of what it wrote), written
  and hashed by that rank (`hashed_write`, and `shard_writer` for its DCP shards);
  `rank_values`: each rank's own values of the per-rank entries, written and read back by
  that rank alone;
  `rank_reports`: the one exchange of fixed-size reports (all-reduces) that tells rank 0
  they are whole;
- `best`: the pointer to the best checkpoint by an eval metric, which retention keeps;
- `discovery`: `step-N` layout, the newest complete checkpoint, `--resume auto|none|PATH`;
- `safe_types`: what a checkpoint may hold and the restricted loader that reads it back;
- `rng`: a rank's RNG states, captured and put back;
- `save` / `load`: the collective save and read-and-agree underneath the Checkpointer;
- `background` / `staging`: the same save with the writes in a thread on every rank, from a
  host copy of the state (`--async-checkpoint`);
- `sharded` / `sharded_reader`: a checkpoint whose sharded state each rank writes its part
  of (FSDP2, with torch.distributed.checkpoint), committed by rank 0 once every part is
  whole, and read back resharded without running pickled code.

What goes into the files is the caller's. Imports `amp`, `distributed` (collectives, the
group), `durable`, `errors` and `version`; nothing above it.
"""

from ddp_amp.checkpoint.best import BestRecord, read_best, write_best
from ddp_amp.checkpoint.checkpointer import Checkpointer, Saved
from ddp_amp.checkpoint.commit import commit_checkpoint, commit_directory
from ddp_amp.checkpoint.discovery import (checkpoint_root, complete_copy, list_step_dirs, newest_complete,
                                          resolve_resume, step_dir_name)
from ddp_amp.checkpoint.layout import SavedState, module_file
from ddp_amp.checkpoint.load import read_checkpoint
from ddp_amp.checkpoint.manifest import IncompleteCheckpoint
from ddp_amp.checkpoint.verify import verify_checkpoint
from ddp_amp.checkpoint.meta import Meta, read_meta
from ddp_amp.checkpoint.retention import apply_retention
from ddp_amp.checkpoint.safe_types import safe_load
from ddp_amp.checkpoint.save import ensure_writable
from ddp_amp.checkpoint.sharded import sharded_tensors

__all__ = [
    "BestRecord", "Checkpointer", "IncompleteCheckpoint", "Meta", "Saved", "SavedState", "apply_retention",
    "checkpoint_root", "commit_checkpoint", "commit_directory", "complete_copy", "ensure_writable", "list_step_dirs",
    "module_file", "newest_complete", "read_best", "read_checkpoint", "read_meta", "resolve_resume", "safe_load",
    "sharded_tensors", "step_dir_name", "verify_checkpoint", "write_best",
]
