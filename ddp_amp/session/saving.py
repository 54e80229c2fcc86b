"""A session's checkpoint methods: its `Checkpointer`'s, in the words of a training loop.

`Session` takes them from `SessionSaving`; each is collective, as the Checkpointer's are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ddp_amp.checkpoint import Checkpointer, Saved, SavedState
from ddp_amp.distributed import DistContext
from ddp_amp.session.arrival import all_arrive

log = logging.getLogger(__name__)
T = TypeVar("T")


class SessionSaving:
    """Save, find, read and restore checkpoints in one layout and commit protocol."""

    # How long `save` waits for every rank to call it before it says it is collective.
    save_arrival_s: float = 30.0

    @property
    def checkpointer(self) -> Checkpointer:
        raise NotImplementedError  # the Session's

    @property
    def ctx(self) -> DistContext:
        raise NotImplementedError  # the Session's

    def save(self, path: str | os.PathLike[str], state: Mapping[str, Any], *,
             per_rank: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
             keep_last: int = 0, background: bool = False) -> Path | None:
        """Save a checkpoint directory at `path`; rank 0 commits it atomically (collective).

        `state` maps names to models (each saved unwrapped, in a file of its own: `model.pt`
        for "model"), optimizers, anything with `state_dict`, and plain values (numbers,
        strings, paths, numpy values, containers of them). `per_rank` maps names to values
        that differ per rank (a data loader's position): each rank writes its own into a file
        of its own and gets its own back, reading no other rank's; they load only on as many
        ranks as saved them. The loss scaler and every rank's RNG state are saved too; `meta`
        goes into meta.json. A directory already at `path` is replaced only if it is a
        checkpoint, and only once the new one is complete. Where `path` is a `step-N`
        directory (`ddp_amp.checkpoint.step_dir_name(step)`), `keep_last` > 0 then keeps only
        the newest that many beside it.

        Returns the path on every rank. With `background`, returns None as soon as the state
        is copied to host memory: rank 0 writes it while training goes on, and the next save
        or `wait_for_save()` learns the outcome. A failed write raises `CheckpointError` on
        every rank (older checkpoints are untouched).

        Called on some ranks only (under `if session.is_main:`), it raises a UsageError on
        those within `save_arrival_s` seconds (30; a `Session` keyword), before anything is
        written: the others never called it.
        """
        ctx = self.ctx
        all_arrive(ctx.store, ctx.world_size, "save", self.save_arrival_s)
        saved = self.checkpointer.save(Path(path), state, per_rank or {}, meta or {}, keep_last, background)
        if saved is None:
            return None
        ctx.progress.checkpoint = str(saved.path)  # the newest checkpoint, for a peer's line about this rank
        return saved.path

    def wait_for_save(self) -> Saved | None:
        """Wait for the background save in flight, if any (collective): where it was saved
        and how long rank 0 took, or its `CheckpointError` raised on every rank."""
        saved = self.checkpointer.wait()
        if saved is not None:
            self.ctx.progress.checkpoint = str(saved.path)
        return saved

    def read(self, path: str | os.PathLike[str], check: Callable[[SavedState], T] | None = None
             ) -> tuple[SavedState, T | None]:
        """Read a `save` checkpoint on every rank, unapplied, and run `check` on it (collective).

        Every rank reads the directory (it must be on a filesystem every rank sees); any
        rank's refusal, a failed read or `check`'s UsageError, is raised on every rank.
        """
        return self.checkpointer.read(Path(path), check)

    def restore(self, saved: SavedState, state: Mapping[str, Any], *, restore_rng: bool = True,
                notice: Callable[[str], None] = log.info) -> dict[str, Any]:
        """Load a `read` checkpoint into the objects of `state` and the scaler (collective):
        see `load`. Returns the saved plain values, with this rank's per-rank ones."""
        return self.checkpointer.restore(saved, state, restore_rng, notice)

    def load(self, path: str | os.PathLike[str], state: Mapping[str, Any], *,
             restore_rng: bool = True) -> dict[str, Any]:
        """Load a `save` checkpoint into the given objects and the scaler; return its values.

        Collective. Every rank reads the directory and checks it holds every key asked for;
        any rank's refusal is raised on every rank before anything is loaded. Rank 0's
        scaler state is authoritative and every rank verifies it agrees. With `restore_rng`
        each rank gets back the RNG streams it saved, so a resumed loop draws what an
        uninterrupted one would. Returns the plain values saved (a step count, say) and this
        rank's own per-rank values.
        """
        saved, _ = self.read(path, self.checkpointer.holds_keys(list(state)))
        return self.restore(saved, state, restore_rng=restore_rng)

    def latest(self, root: str | os.PathLike[str]) -> Path | None:
        """The newest complete `step-N` checkpoint under `root`, or None (collective: rank 0
        verifies the manifests, every rank gets the answer)."""
        return self.checkpointer.latest(Path(root))
