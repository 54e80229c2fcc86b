"""`Checkpointer`: the one object behind every checkpoint of a run, the Trainer's and a
`Session` loop's: saved in the one layout (layout.py) now or in the background, found
(the newest complete one, `--resume auto|none|PATH`), read and checked on every rank before
anything is applied, then restored (DCP shards resharded onto this world, each rank's RNG).
Finding and reading check on each rank only the files that rank reads, agreed (verify.py).

Saving is collective: every rank calls it; each rank writes and hashes its own files (its
RNG states, its values of the per-rank entries, its shards of a sharded state) and rank 0
commits through `ddp_amp.checkpoint`'s protocol once every rank reported them whole
(temporary directory, fsync, manifest, atomic rename, retention after the commit: each rank
deletes its own files of the checkpoints let go, in a thread of its own, and rank 0 what is
left). A background save returns once the state is copied to host memory;
each rank's writer thread writes its files and rank 0's commits, one write in flight, and
the outcome reaches every rank at the next save or `wait`. A failed write raises the same
`CheckpointError` on every rank, wherever it is learned; older checkpoints stay.
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

from ddp_amp.amp import AgreedGradScaler, Precision
from ddp_amp.checkpoint.background import BackgroundSaver
from ddp_amp.checkpoint.best import BestRecord, read_best, write_best
from ddp_amp.checkpoint.discovery import (candidate_dirs, checkpoint_root, copies_of, list_step_dirs,
                                          resolve_resume, resume_candidates, step_dir_name)
from ddp_amp.checkpoint.layout import (SCALER_KEY, SavedState, check_keys, layout_files, load_into, saved_state,
                                       state_of)
from ddp_amp.checkpoint.load import LoadedCheckpoint, read_agreed, restore_scaler
from ddp_amp.checkpoint.meta import Meta, read_meta
from ddp_amp.checkpoint.rank_values import agree_loadable
from ddp_amp.checkpoint.retention import Retention
from ddp_amp.checkpoint.rng import restore_rng as restore_rng_states
from ddp_amp.checkpoint.save import save_checkpoint
from ddp_amp.checkpoint.sharded import load_sharded
from ddp_amp.checkpoint.sharded_state import dcp_form, put_back, restore_full, sharded_keys
from ddp_amp.checkpoint.verify import agree_on
from ddp_amp.distributed import DistContext, mark_agreed, on_rank_zero
from ddp_amp.errors import UsageError
from ddp_amp.torch_api import lazily_connected_gloo, tree_map

T = TypeVar("T")


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint: where, and how long rank 0 took to write it."""

    path: Path
    seconds: float
    background: bool = False


def _to_host(value: Any) -> Any:
    """A per-rank value as this rank saves it: tensors detached, each a private copy on the
    CPU, so a background write holds the value of the call whatever the loop changes in place."""
    return tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, state_of(value))


def _listed(found: tuple[list[Path], bool]) -> tuple[list[str], bool]:
    """`resume_candidates`' answer as it is sent to every rank."""
    return [str(path) for path in found[0]], found[1]


class Checkpointer:
    """Save, find, read and restore the checkpoints of one process group's state.

    The methods of an instance are collectives (every rank calls them alike); the static
    ones read the disk on the calling rank alone, for decisions made before a run starts.
    """

    def __init__(self, ctx: DistContext, precision: Precision, scaler: AgreedGradScaler,
                 warn: Callable[[str], None]) -> None:
        self.ctx, self.precision, self.scaler, self.warn = ctx, precision, scaler, warn
        self._background = BackgroundSaver()
        self._group: dist.ProcessGroup | None = None
        self._retention = Retention()  # this rank's part: old checkpoints deleted while training goes on
        self._verified: set[Path] = set()  # checkpoints every rank has checked its files of

    def _save_group(self) -> dist.ProcessGroup | None:
        """The process group background saves talk over (made once, collective): one of
        their own, on gloo, since training's collectives go on while they write; None
        without a process group. It connects a pair of ranks only when a collective first
        joins them (an all-reduce's ring: two peers a rank), not every pair as it forms
        (16,383 connections a rank at 16,384 ranks: `torch_api.lazily_connected_gloo`)."""
        if self._group is None and dist.is_initialized():
            if not dist.is_gloo_available():
                raise UsageError("--async-checkpoint", "on", "a torch with the gloo backend, which background saves "
                                 "talk over beside training", "this torch has none: save synchronously (drop "
                                 "--async-checkpoint, or background=False)")
            with lazily_connected_gloo():
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
        self._verified.discard(target)  # written anew: checked anew before it is read
        started = time.perf_counter()
        own = {key: _to_host(value) for key, value in sorted(per_rank.items())}
        agree_loadable(own, self.ctx.device)  # any rank's refusal on every rank, before anything is written
        sharded = sharded_keys(state)
        files, listed = layout_files({k: v for k, v in state.items() if k not in sharded}, self.scaler.state_dict(),
                                     sorted(per_rank))
        if sharded:  # written by every rank, each its shards, under sharded/
            listed["modules"] = sorted(listed["modules"] + [k for k in sharded if isinstance(state[k], nn.Module)])
            listed["sharded"] = sharded
        description = Meta(saved_by="ddp_amp", precision=self.precision.name, loss_scaling=self.scaler.is_enabled(),
                           scaler_skipped_total=int(self.scaler.skipped_steps().item())).merged({**listed, **meta})
        shards = dcp_form(state, sharded) if sharded else None
        if background:
            self._background.start(target, files, description, self.ctx.device, self.ctx.world_size, keep_last,
                                   self._save_group(), self._retention, shards, own)
            return None
        result = save_checkpoint(target, files, description, self.ctx.device, self.ctx.world_size, keep_last,
                                 self._retention, shards, own)
        self._retention.let_go_own(result.retired, self.ctx.rank, self.ctx.world_size)
        if result.error is not None:
            raise mark_agreed(result.error, 0)  # the same outcome on every rank
        return Saved(target, time.perf_counter() - started)

    def wait(self) -> Saved | None:
        """The outcome of the background save in flight, if any (collective): the committed
        checkpoint, or its CheckpointError raised on every rank."""
        finished = self._background.wait()
        if finished is None:
            return None
        self._retention.let_go_own(finished.retired, self.ctx.rank, self.ctx.world_size)
        if finished.path is None:
            raise mark_agreed(finished.error, 0)  # type: ignore[arg-type]  # no path: it failed, error is set
        return Saved(finished.path, finished.write_s, background=True)

    def join_locally(self) -> None:
        """At the end of a session, or on a failure path: let this rank's write finish or
        fail, and its part of retention's deletion end, talking to no other rank; rank 0
        then removes what is left of the checkpoints retention let go. After it rank 0's
        folder holds only what retention kept: a caller that lists it sees no `.tmp-retired-`
        names."""
        self._background.join_locally()
        self._retention.end(remove_remains=self.ctx.rank == 0)

    def read(self, path: Path, check: Callable[[SavedState], T] | None = None,
             what: str = "checkpoint") -> tuple[SavedState, T | None]:
        """Every rank reads checkpoint `path` and runs `check` on it (collective); any rank's
        refusal is raised on every rank before anything is applied."""
        def checked(loaded: LoadedCheckpoint) -> tuple[SavedState, T | None]:
            saved = saved_state(loaded)
            return saved, (check(saved) if check is not None else None)

        _, result = read_agreed(self._find(path), None, checked, what=what, rank=self.ctx.rank)
        return result

    def _agree(self, candidates: list[str], warn: Callable[[str], None]) -> tuple[Path | None, str]:
        """The first of `candidates` every rank finds complete (collective; see verify.py)."""
        return agree_on([Path(path) for path in candidates], self.ctx.rank, self.ctx.world_size, warn,
                        self._verified, self.ctx.device)

    def _find(self, path: Path) -> Path:
        """`path`, or the complete copy a crash during a re-save left beside it; else UsageError
        (collective: every rank checks the files it reads)."""
        copies = on_rank_zero(lambda: [str(copy) for copy in copies_of(path)])
        found, reason = self._agree(copies, self.warn)
        if found is not None:
            return found
        if copies:
            raise mark_agreed(UsageError("checkpoint", str(path), "a complete checkpoint directory written by "
                                         "Session.save", "it could not be read (no valid manifest.json); it may be "
                                         f"torn or not a checkpoint ({reason})"), 0)
        raise mark_agreed(UsageError("checkpoint", str(path), "an existing checkpoint directory",
                                     "check the path; Session.save writes it"), 0)

    def latest(self, root: Path) -> Path | None:
        """The newest complete `step-N` checkpoint under `root`, or None (collective: rank 0
        checks that the files are there, each rank hashes those it reads, all agree)."""
        return self._agree(on_rank_zero(lambda: [str(path) for path in candidate_dirs(root)]), self.warn)[0]

    def choose(self, choice: str, root: Path, warn: Callable[[str], None] | None = None) -> Path | None:
        """`--resume auto|none|PATH` resolved against checkpoint folder `root`: a complete
        checkpoint, or None to start fresh (collective, checked as `latest` checks; each one
        skipped is told to `warn`, the session's log by default). A PATH that names one
        checkpoint which fails the check is refused on every rank."""
        if choice == "none":
            return None
        candidates, named = on_rank_zero(lambda: _listed(resume_candidates(choice, root)))
        found, reason = self._agree(candidates, (lambda _: None) if named else (warn or self.warn))
        if found is not None or not (named or candidates) or choice == "auto":
            return found
        if named:
            raise mark_agreed(UsageError("--resume", choice, "a complete checkpoint directory (step-N with a "
                                         "manifest.json)", reason), 0)
        raise mark_agreed(UsageError("--resume", choice, "a folder holding a complete checkpoint",
                                     "every step-N in it failed its manifest check (see the warnings)"), 0)

    def restore(self, saved: SavedState, state: Mapping[str, Any], restore_rng: bool,
                notice: Callable[[str], None]) -> dict[str, Any]:
        """Load `saved` into the objects of `state` and into the scaler (collective where the
        scaler scales: rank 0's state is authoritative, every rank verifies it agrees); give
        this rank its RNG streams back; return the plain values and this rank's per-rank ones."""
        rank, from_dcp = self.ctx.rank, [key for key in state if key in saved.sharded]
        if from_dcp:  # resharded onto this world, into sharded objects or not
            put_back(state, load_sharded(saved.path, dcp_form(state, from_dcp)))
        live_sharded = set(sharded_keys(state))
        for key, obj in state.items():
            if key in from_dcp:
                continue
            value = saved.per_rank[key] if saved.saved_per_rank(key, self.ctx.world_size) else saved.value(key)
            if key in live_sharded:  # a replicated checkpoint's full state into a sharded object
                restore_full(state, key, value)
            else:
                load_into(obj, value)
        restore_scaler(self.scaler, saved.values.get(SCALER_KEY) or {}, saved.scaler_skipped_total,
                       self.precision.name, str(saved.meta.precision), notice)
        if restore_rng and rank in saved.rng:
            restore_rng_states(saved.rng[rank], self.ctx.device)
        values = {key: value for key, value in saved.values.items() if key != SCALER_KEY}
        if saved.per_rank_ranks == self.ctx.world_size:
            values.update(saved.per_rank)
        return values

    def holds_keys(self, keys: list[str]) -> Callable[[SavedState], None]:
        """A `read` check: the checkpoint holds every key asked for, and its per-rank ones
        were saved by as many ranks as there are now."""
        def check(saved: SavedState) -> None:
            for key in keys:
                if not saved.holds(key):
                    raise UsageError("checkpoint key", key, f"one of {saved.keys()}",
                                     "save it first, or leave it out of the load")
                saved.saved_per_rank(key, self.ctx.world_size)  # another number of ranks is refused
        return check

    def keep_best(self, root: Path, record: BestRecord) -> None:
        """Point `root`'s best.json at `record`'s checkpoint, which retention then keeps
        (collective: rank 0 writes, every rank learns the outcome)."""
        on_rank_zero(lambda: write_best(root, record))

    # -- on the calling rank alone: the layout on disk, for decisions before a run starts ---

    @staticmethod
    def root_of(run_dir: Path) -> Path:
        """Where a run directory keeps its `step-N` checkpoints."""
        return checkpoint_root(run_dir)

    @staticmethod
    def step_path(root: Path, step: int) -> Path:
        """The directory of the checkpoint at `step` under `root`."""
        return root / step_dir_name(step)

    @staticmethod
    def steps(root: Path) -> list[tuple[int, Path]]:
        """(step, path) of every `step-N` directory under `root`, oldest first, unverified."""
        return list_step_dirs(root)

    @staticmethod
    def resolve(choice: str, root: Path, warn: Callable[[str], None]) -> Path | None:
        """`--resume auto|none|PATH` as a verified checkpoint directory, or None (this rank only)."""
        return resolve_resume(choice, root, warn)

    @staticmethod
    def read_meta(path: Path) -> Meta:
        """Checkpoint `path`'s meta.json, without reading any tensor."""
        return read_meta(path)

    @staticmethod
    def best(root: Path) -> BestRecord | None:
        """The best checkpoint `root`'s best.json records, if any."""
        return read_best(root)
