"""The Trainer's checkpoints: what it saves, when a save is skipped or waited for, and what
every rank learns of each save.

Saves go through the run core (`Session.save`, the one layout and commit protocol), as
`<run-dir>/checkpoints/step-NNNNNNNN/` with `--keep-last` retention; what goes in is
resume.py's `TrainingParts` plus the step, the samples seen and the data position. A save
at the cadence may run in the background (`--async-checkpoint`: one in flight, its outcome
learned at the next save); the final, preemption and `--keep-best` saves wait for it. A
step already saved is not written again. Before any save the LR plan is settled (the
scheduler's state must be exact) and the watchdogs check that the state is finite: that
check may stop the run on every rank, with nothing written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_amp.errors import CheckpointError
from ddp_amp.guards import RunWatch
from ddp_amp.session import Meta, Session
from ddp_amp.trainer.resume import DATA_IDENTITY, Restored, TrainingParts, restore_training_state
from ddp_amp.trainer.schedules import SchedulerDriver


class RunCheckpoints:
    """One run's checkpoints under `root` (None: checkpointing off, as in library use)."""

    def __init__(self, session: Session, parts: TrainingParts, root: Path | None, *, keep_last: int,
                 config: dict[str, Any], schedule: SchedulerDriver | None, watch: RunWatch,
                 info: Callable[[str], None], data_identity: str = "") -> None:
        self.session, self.parts, self.root, self.keep_last = session, parts, root, keep_last
        self.data_identity = data_identity  # Task.data_identity: a resume compares it (resume_plan.py)
        self.config, self.schedule, self.watch, self.info = config, schedule, watch, info
        self.last: Path | None = None  # the newest this run committed or resumed from
        self.error: CheckpointError | None = None  # why the last save failed, the same on every rank
        self._saved_step: int | None = None
        self._writing_step: int | None = None  # the step a background save is writing

    def save(self, step: int, samples_seen: int, background: bool = False) -> Path | None:
        """Commit the state at `step` (collective): its directory, or None where checkpointing
        is off or the save was started in the background. A failed write raises
        CheckpointError on every rank (it is also kept in `error`); older ones stay."""
        if self.root is None:
            return None
        self.wait()  # one in flight: the previous background save's outcome first
        if self._saved_step == step:
            return self.session.checkpointer.step_path(self.root, step)
        try:
            started = time.perf_counter()
            if self.schedule is not None:
                self.schedule.before_checkpoint()
            self.watch.before_checkpoint(step, self._resume_hint())  # may stop every rank, nothing written
            target = self.session.checkpointer.step_path(self.root, step)
            path = self.session.save(target, self._state(step, samples_seen),
                                     per_rank=self._per_rank(), meta=self._meta(step), keep_last=self.keep_last,
                                     background=background)
        except CheckpointError as error:
            self._failed(step, error)
            raise
        if path is None:
            self._writing_step = step
            self.info(f"checkpoint {target.name} started in the background "
                      f"(stall {time.perf_counter() - started:.2f} s)")
        else:
            self._committed(step, path, time.perf_counter() - started, "")
        return path

    def save_for_stop(self, step: int, samples_seen: int) -> Path | None:
        """A preemption's save (collective): its directory, or None if it failed (`error` says why)."""
        try:
            return self.save(step, samples_seen)
        except CheckpointError:
            return None

    def wait(self) -> Path | None:
        """The background save in flight, waited for (collective); `last` then. A failed one
        raises its CheckpointError on every rank."""
        step, self._writing_step = self._writing_step, None
        try:
            saved = self.session.wait_for_save()
        except CheckpointError as error:
            self._failed(step, error)
            raise
        if saved is not None:
            self._committed(step or 0, saved.path, saved.seconds, " in the background")
        return self.last

    def load(self, path: Path, optimizer_may_change: bool) -> Restored:
        """Resume from checkpoint `path` (collective); see resume.py."""
        restored = restore_training_state(self.session, path, self.parts, self.info, optimizer_may_change)
        # Saving this step again would only rewrite what is there; elsewhere (another run's
        # checkpoint) it must still be written into this run's directory.
        own = self.root is not None and \
            path.resolve() == self.session.checkpointer.step_path(self.root, restored.step).resolve()
        self._saved_step = restored.step if own else None
        self.last = path
        return restored

    def _failed(self, step: int | None, error: CheckpointError) -> None:
        self.error = error
        self.info(f"checkpoint at step {step} failed: {error}")

    def _committed(self, step: int, path: Path, seconds: float, how: str) -> None:
        self._saved_step, self.last, self.error = step, path, None
        self.session.ctx.progress.checkpoint = str(path)  # named by a worker that stops without its launcher
        self.info(f"saved checkpoint {path} ({seconds:.2f} s{how})")

    def _state(self, step: int, samples_seen: int) -> dict[str, Any]:
        parts = self.parts
        state = {"model": parts.model, "optimizer": parts.optimizer_state(), "scheduler": parts.scheduler,
                 "step": step, "samples_seen": samples_seen}
        if not parts.per_rank_position:  # else each rank's own position, under per_rank
            state["data"] = parts.stream.state_dict()
        return state

    def _per_rank(self) -> dict[str, Any]:
        per_rank: dict[str, Any] = {}
        if self.parts.per_rank_position:
            per_rank["data"] = self.parts.stream.state_dict()
        if self.parts.task_state is not None:
            per_rank["task_state"] = self.parts.task_state
        return per_rank

    def _meta(self, step: int) -> dict[str, Any]:
        """What a resume checks before it loads any tensor."""
        stream = self.parts.stream
        meta = Meta(saved_by="ddp_amp.Trainer", step=step, micro_batch_size=stream.micro_batch_size,
                    dp_size=self.session.ctx.dp_size,  # what the data position is a position over
                    batches_per_epoch=stream.batches_per_epoch, optimizer_class=self.parts.optimizer_names(),
                    config=self.config).to_dict()
        return {**meta, DATA_IDENTITY: self.data_identity} if self.data_identity else meta

    def _resume_hint(self) -> str:
        if self.last is None:
            return "no checkpoint of this run holds a finite state yet: start again (--resume none)"
        return f"resume from {self.last}, the newest finite checkpoint (--resume auto picks it)"
