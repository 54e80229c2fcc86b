"""A session's checkpoints: saved in the one layout (layout.py), now or in the background,
read and checked on every rank before anything is applied, then restored.

Saving is collective: every rank calls it; per-rank entries are gathered, RNG states too,
and rank 0 commits through `ddp_amp.checkpoint`'s protocol (temporary directory, fsync,
manifest, atomic rename, retention after the commit). A background save returns once the
state is copied to host memory; rank 0's writer thread commits it (every rank's writes its
own shards of a sharded state first), one write in flight,
and the outcome reaches every rank at the next save or `wait`. A failed write raises the
same `CheckpointError` on every rank, wherever it is learned; older checkpoints stay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ddp_amp import checkpoint
from ddp_amp.amp import AgreedGradScaler, Precision
from ddp_amp.distributed import DistContext, all_gather_objects, mark_agreed, on_rank_zero
from ddp_amp.errors import UsageError
from ddp_amp.session.layout import (SCALER_KEY, SavedState, check_keys, layout_files, load_into, saved_state,
                                    state_of)
from ddp_amp.session.models import SessionModels
from ddp_amp.session.sharded_state import dcp_form, put_back, restore_full, sharded_keys

T = TypeVar("T")


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint: where, and how long rank 0 took to write it."""

    path: Path
    seconds: float
    background: bool = False


def _to_host(value: Any) -> Any:
    """A per-rank value as every rank's copy is gathered: tensors detached, on the CPU."""
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, state_of(value))


class SessionCheckpoints:
    """Save, read and restore checkpoints of one session's state (collectives throughout)."""

    def __init__(self, ctx: DistContext, precision: Precision, scaler: AgreedGradScaler, models: SessionModels,
                 warn: Callable[[str], None]) -> None:
        self.ctx, self.precision, self.scaler, self.models, self.warn = ctx, precision, scaler, models, warn
        self._background = checkpoint.BackgroundSaver()
        self._group: dist.ProcessGroup | None = None

    def _save_group(self) -> dist.ProcessGroup:
        """The process group background sharded saves talk over (made once, collective): one
        of their own, on gloo, since training's collectives go on while they write."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint a background save is still writing, if any (the same on every rank)."""
        return self._background.in_flight

    def save(self, target: Path, state: Mapping[str, Any], per_rank: Mapping[str, Any], meta: Mapping[str, Any],
             keep_last: int, background: bool) -> Saved | None:
        """Commit `state` as the checkpoint `target` (collective); see `Session.save`."""
        check_keys(state, per_rank)
        self.wait()  # one write in flight: a failed earlier one raises here, on every rank
        started = time.perf_counter()
        gathered = {key: all_gather_objects(_to_host(value)) for key, value in sorted(per_rank.items())}
        sharded = sharded_keys(state)
        files, listed = layout_files({k: v for k, v in state.items() if k not in sharded}, self.scaler.state_dict(),
                                     gathered)
        if sharded:  # written by every rank, each its shards, under sharded/
            listed["modules"] = sorted(listed["modules"] + [k for k in sharded if isinstance(state[k], nn.Module)])
            listed["sharded"] = sharded
        description = {"saved_by": "ddp_amp", "precision": self.precision.name,
                       "loss_scaling": self.scaler.is_enabled(),
                       "scaler_skipped_total": int(self.scaler.skipped_steps().item()), **listed, **meta}
        if sharded:
            if background:
                self._background.start_sharded(target, files, description, dcp_form(state, sharded), self.ctx.device,
                                               self.ctx.world_size, keep_last, self._save_group())
                return None
            result = checkpoint.save_sharded(target, files, description, dcp_form(state, sharded), self.ctx.device,
                                             self.ctx.world_size, keep_last)
            if result.error is not None:
                raise mark_agreed(result.error, 0)
            return Saved(target, time.perf_counter() - started)
        if background:
            self._background.start(target, files, description, self.ctx.device, self.ctx.world_size, keep_last)
            return None
        result = checkpoint.save_directory(target, files, description, self.ctx.device, self.ctx.world_size,
                                           keep_last)
        if result.error is not None:
            raise mark_agreed(result.error, 0)  # the same outcome on every rank
        return Saved(target, time.perf_counter() - started)

    def wait(self) -> Saved | None:
        """The outcome of the background save in flight, if any (collective): the committed
        checkpoint, or its CheckpointError raised on every rank."""
        finished = self._background.wait()
        if finished is None:
            return None
        if finished.path is None:
            raise mark_agreed(finished.error, 0)  # type: ignore[arg-type]
        return Saved(finished.path, finished.write_s, background=True)

    def join_locally(self) -> None:
        """On a failure path: let rank 0's write finish or fail, talking to no other rank."""
        self._background.join_locally()

    def read(self, path: Path, check: Callable[[SavedState], T] | None = None,
             what: str = "checkpoint") -> tuple[SavedState, T | None]:
        """Every rank reads checkpoint `path` and runs `check` on it (collective); any rank's
        refusal is raised on every rank before anything is applied."""
        def checked(loaded: checkpoint.LoadedCheckpoint) -> tuple[SavedState, T | None]:
            saved = saved_state(loaded)
            return saved, (check(saved) if check is not None else None)

        target = on_rank_zero(lambda: self._find(path))  # one rank hashes the files
        _, result = checkpoint.read_agreed(target, None, checked, what=what)
        return result

    def _find(self, path: Path) -> Path:
        """`path`, or the complete copy a crash during a re-save left beside it; else UsageError."""
        found = checkpoint.complete_copy(path, self.warn)
        if found is not None:
            return found
        if path.exists():
            raise UsageError("checkpoint", str(path), "a complete checkpoint directory written by Session.save",
                             "it could not be read (no valid manifest.json); it may be torn or not a checkpoint")
        raise UsageError("checkpoint", str(path), "an existing checkpoint directory",
                         "check the path; Session.save writes it")

    def latest(self, root: Path) -> Path | None:
        """The newest complete `step-N` checkpoint under `root`, or None (collective: rank 0
        verifies the manifests, every rank gets the answer)."""
        return on_rank_zero(lambda: checkpoint.newest_complete(root, self.warn))

    def restore(self, saved: SavedState, state: Mapping[str, Any], restore_rng: bool,
                notice: Callable[[str], None]) -> dict[str, Any]:
        """Load `saved` into the objects of `state` and into the scaler (collective where the
        scaler scales: rank 0's state is authoritative, every rank verifies it agrees); give
        this rank its RNG streams back; return the plain values and this rank's per-rank ones."""
        rank, from_dcp = self.ctx.rank, [key for key in state if key in saved.sharded]
        if from_dcp:  # resharded onto this world, into sharded objects or not
            put_back(state, checkpoint.load_sharded(saved.path, dcp_form(state, from_dcp)))
        live_sharded = set(sharded_keys(state))
        for key, obj in state.items():
            if key in from_dcp:
                continue
            value = saved.per_rank[key][rank] if key in saved.per_rank else saved.value(key)
            if key in live_sharded:  # a replicated checkpoint's full state into a sharded object
                restore_full(state, key, value)
            else:
                load_into(obj, value)
        checkpoint.restore_scaler(self.scaler, saved.values.get(SCALER_KEY) or {}, saved.scaler_skipped_total,
                                  self.precision.name, str(saved.meta.get("precision")), notice)
        if restore_rng and rank < len(saved.rng):
            checkpoint.restore_rng(saved.rng[rank], self.ctx.device)
        values = {key: value for key, value in saved.values.items() if key != SCALER_KEY}
        if saved.world_size == self.ctx.world_size:
            values.update({key: ranks[rank] for key, ranks in saved.per_rank.items()})
        return values

    def holds_keys(self, keys: list[str]) -> Callable[[SavedState], None]:
        """A `read` check: the checkpoint holds every key asked for, and its per-rank ones
        were saved by as many ranks as there are now."""
        def check(saved: SavedState) -> None:
            for key in keys:
                if not saved.holds(key):
                    raise UsageError("checkpoint key", key, f"one of {saved.keys()}",
                                     "save it first, or leave it out of the load")
                if key in saved.per_rank and len(saved.per_rank[key]) != self.ctx.world_size:
                    raise UsageError("checkpoint key", key, f"a per-rank entry saved by {self.ctx.world_size} rank(s)",
                                     f"it was saved by {len(saved.per_rank[key])}; resume with that many ranks")
        return check
