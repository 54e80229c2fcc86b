"""The Trainer's saves: synchronous, or started in the background (`--async-checkpoint`),
one in flight at most, their outcome the same on every rank.

A mixin of `Trainer` (loop.py), kept apart because it is one concept: when and how the
current step's state is committed. It reads the Trainer's `step`, `samples_seen`, `config`,
`ctx`, `device`, `precision`, `run_log`, `watch` and `schedule`, and `_parts()`; it owns
`checkpoint_root`, `checkpoint_error`, `last_checkpoint`, `background` and `_saved_step`,
which the Trainer sets up. The files are checkpointing.py's, the protocol `ddp_amp.checkpoint`'s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ddp_amp import checkpoint
from ddp_amp.distributed import mark_agreed
from ddp_amp.trainer.checkpointing import run_meta, training_files


class CheckpointSaves:
    """Saving the Trainer's state: see the module docstring for what it needs from the Trainer."""

    checkpoint_root: Path | None
    checkpoint_error: checkpoint.CheckpointError | None
    last_checkpoint: Path | None
    background: checkpoint.BackgroundSaver
    _saved_step: int | None

    def save_checkpoint(self) -> Path | None:
        """Commit a checkpoint of the current step (collective: call on every rank).

        Returns the checkpoint directory on every rank, or None on every rank if the write
        failed (the reason is in `self.checkpoint_error`; older checkpoints are untouched)
        or checkpointing is off. Saving the same step twice writes it once. A save still
        being written in the background is waited for first; if that one failed, its
        failure is this call's.
        """
        root = self._save_root()
        if root is None:
            return None
        if self._saved_step == self.step:
            return root / checkpoint.step_dir_name(self.step)
        started = time.perf_counter()
        files, meta = self._state_to_save()
        result = checkpoint.save_checkpoint(root, self.step, files, meta, self.device, self.ctx.world_size,
                                            self.config.keep_last)
        return self._learn_outcome(self.step, result.path, result.error, time.perf_counter() - started)

    def _cadence_checkpoint(self) -> None:
        """The --ckpt-every save: in the background under --async-checkpoint (collective)."""
        if self.config.async_checkpoint:
            self.start_checkpoint()
        else:
            self._checkpoint_or_raise()

    def start_checkpoint(self) -> None:
        """Start a checkpoint of the current step that rank 0 writes in the background (collective).

        Returns once the state is gathered and copied into host memory; the next save, or
        `wait_for_checkpoint`, learns how the write ended. The save before it is waited for
        first: if that one failed, its CheckpointError is raised here, on every rank.
        """
        started = time.perf_counter()  # the stall logged includes waiting for the previous write
        root = self._save_root()
        if root is None:
            if self.checkpoint_error is not None:  # the previous background write failed
                raise mark_agreed(self.checkpoint_error, 0)
            return
        if self._saved_step == self.step:  # --keep-best saved this step already
            return
        files, meta = self._state_to_save()
        self.background.start(root, self.step, files, meta, self.device, self.ctx.world_size, self.config.keep_last)
        self.run_log.info(f"checkpoint {checkpoint.step_dir_name(self.step)} started in the background "
                          f"(stall {time.perf_counter() - started:.2f} s)")

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for the background save in flight, if any (collective); `last_checkpoint` then,
        or None on every rank if that save failed (the reason in `checkpoint_error`)."""
        if self.checkpoint_root is None:
            return None
        finished = self.background.wait()
        if finished is not None:
            return self._learn_outcome(finished.step, finished.path, finished.error, finished.write_s,
                                       how=" in the background")
        return self.last_checkpoint

    def _save_root(self) -> Path | None:
        """What every save does first (collective): the directory to save into, or None where
        checkpointing is off or the save in flight in the background failed (its error is
        then in `checkpoint_error`)."""
        if self.schedule is not None:
            self.schedule.before_checkpoint()
        if self.checkpoint_root is None:
            return None
        if self.background.in_flight is not None and self.wait_for_checkpoint() is None:
            return None
        return self.checkpoint_root

    def _state_to_save(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The current step's files and meta.json description, once it is known finite (collective)."""
        self.watch.before_checkpoint(self.step, self._resume_hint())
        meta = run_meta(self.config.to_dict(), self._parts(), self.precision.name, self.step)
        return training_files(self._parts(), self.step, self.samples_seen), meta

    def _learn_outcome(self, step: int, path: Path | None, error: checkpoint.CheckpointError | None,
                       seconds: float, how: str = "") -> Path | None:
        """Record a save's outcome, the same on every rank: `last_checkpoint` names only committed ones."""
        self.checkpoint_error = error
        if path is None:
            self.run_log.info(f"checkpoint at step {step} failed: {error}")
            return None
        self._saved_step, self.last_checkpoint = step, path
        self.ctx.progress.checkpoint = str(path)  # named by a worker that stops without its launcher
        self.run_log.info(f"saved checkpoint {path} ({seconds:.2f} s{how})")
        return path

    def _resume_hint(self) -> str:
        if self.last_checkpoint is None:
            return "no checkpoint of this run holds a finite state yet: start again (--resume none)"
        return f"resume from {self.last_checkpoint}, the newest finite checkpoint (--resume auto picks it)"

    def _checkpoint_or_raise(self) -> Path | None:
        path = self.save_checkpoint()
        if path is None and self.checkpoint_error is not None:
            raise mark_agreed(self.checkpoint_error, 0)  # the same SaveResult on every rank
        return path
