"""Loading as a collective: read and check on every rank, agree, then apply.

Nothing from a checkpoint is executed: every file goes through `safe_load`
(`torch.load(weights_only=True)` with a small allow-list). Every rank reads the files
itself (the directory must be on a filesystem every rank sees) and runs the caller's
checks; any rank's refusal is raised on every rank (`distributed.on_every_rank`) before anything
is applied, so a refused checkpoint leaves the live objects untouched everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ddp_amp.amp import AgreedGradScaler
from ddp_amp.checkpoint.manifest import IncompleteCheckpoint, ranks_record, read_manifest
from ddp_amp.checkpoint.meta import Meta, read_meta
from ddp_amp.checkpoint.rank_values import read_own_values
from ddp_amp.checkpoint.safe_types import safe_load
from ddp_amp.checkpoint.rng import LEGACY_RNG_FILE, RNG_DIR, rng_file
from ddp_amp.distributed import all_gather_objects, broadcast_object, on_every_rank
from ddp_amp.errors import UsageError

T = TypeVar("T")


@dataclass
class LoadedCheckpoint:
    """One checkpoint's contents, read from disk, not yet applied."""

    path: Path
    meta: Meta
    files: dict[str, Any]
    rng: dict[int, dict[str, Any]]  # the RNG states read: the reading rank's, by its rank
    rng_ranks: int = 0  # how many ranks' RNG states the checkpoint holds
    rank: int | None = None  # the reading rank (None: read for no rank of a run)
    own: dict[str, Any] = field(default_factory=dict)  # its values of the per-rank entries each rank wrote
    own_ranks: int = 0  # how many ranks wrote those (0: none did; older checkpoints keep them in `files`)


def _read_rng(path: Path, manifest: dict[str, Any], rank: int | None) -> tuple[dict[int, dict[str, Any]], int]:
    """Rank `rank`'s RNG states in checkpoint `path` (none for None), and how many ranks have some."""
    listed = manifest["files"]
    if LEGACY_RNG_FILE in listed:  # the oldest layout: every rank's in one file, read whole
        ranks = list(safe_load(path / LEGACY_RNG_FILE)["ranks"] or []) if rank is not None else []
        return ({rank: ranks[rank]} if rank is not None and rank < len(ranks) else {}), len(ranks)
    ranks_written = ranks_record(manifest)
    if ranks_written is not None:  # each rank wrote its own, listed in its record
        count, own = ranks_written.count, rank is not None and rank < ranks_written.count
    else:  # format 1: rank 0 wrote every rank's, listed in the manifest
        count = sum(1 for name in listed if name.startswith(f"{RNG_DIR}/"))
        own = rank is not None and rng_file(rank) in listed
    return ({rank: safe_load(path / rng_file(rank))} if own and rank is not None else {}), count


def _read_own(path: Path, manifest: dict[str, Any], meta: Meta, rank: int | None) -> tuple[dict[str, Any], int]:
    """Rank `rank`'s values of the per-rank entries where each rank wrote its own, and how
    many ranks did; ({}, 0) where there are none, or where they are rank 0's files of every
    rank's values, as older checkpoints hold them (read with the other files)."""
    keys, ranks = meta.per_rank or (), ranks_record(manifest)
    if not keys or ranks is None or any(f"{key}.pt" in manifest["files"] for key in keys):
        return {}, 0
    return read_own_values(path, rank, ranks.count), ranks.count


def read_checkpoint(path: Path, names: Sequence[str] | None = None, what: str = "--resume",
                    rank: int | None = None) -> LoadedCheckpoint:
    """Read `meta.json`, the named files of checkpoint `path` and, for a `rank`, that rank's
    RNG states and per-rank values (no collectives); `names` None: every replicated `.pt`
    file its manifest lists."""
    meta = read_meta(path, what)
    try:
        manifest = read_manifest(path)
    except IncompleteCheckpoint as error:
        raise UsageError(what, str(path), "a complete checkpoint", str(error)) from None
    if names is None:
        names = sorted(name for name in manifest["files"] if name.endswith(".pt") and "/" not in name
                       and name != LEGACY_RNG_FILE)
    files = {name: safe_load(path / name) for name in names}
    rng, count = _read_rng(path, manifest, rank)
    own, own_ranks = _read_own(path, manifest, meta, rank)
    return LoadedCheckpoint(path, meta, files, rng, count, rank, own, own_ranks)


def _as_usage_error(error: Exception, path: Path, what: str) -> UsageError:
    if isinstance(error, UsageError):
        return error
    reason = f"{type(error).__name__}: {error}"[:300]
    return UsageError(what, str(path), "a readable ddp_amp checkpoint", reason)


def read_agreed(path: Path, names: Sequence[str] | None, check: Callable[[LoadedCheckpoint], T],
                what: str = "--resume", rank: int | None = None) -> tuple[LoadedCheckpoint, T]:
    """Every rank reads checkpoint `path` and runs `check` on it (collective).

    Returns (the checkpoint, what `check` returned). If reading or checking fails on any
    rank, every rank raises that rank's error as a UsageError, before anything is applied.
    """
    def read_and_check() -> tuple[LoadedCheckpoint, T]:
        try:
            loaded = read_checkpoint(path, names, what, rank)
            return loaded, check(loaded)
        except (UsageError, OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
            raise _as_usage_error(error, path, what) from None

    return on_every_rank(read_and_check)


def restore_scaler(scaler: AgreedGradScaler, saved: dict[str, Any], skipped_total: int,
                   precision: str, saved_precision: str, notice: Callable[[str], None]) -> None:
    """Load the scaler with rank 0's state as authoritative, then verify every rank agrees.

    Collective when loss scaling is on (a broadcast and an all-gather); a no-op otherwise.
    """
    if not scaler.is_enabled():
        if saved:
            notice(f"checkpoint was saved under {saved_precision} with loss scaling; "
                   f"{precision} needs no scaler, so its state is ignored")
        return
    if not saved:
        notice(f"checkpoint has no loss-scaler state (saved under {saved_precision}); "
               f"{precision} starts with a fresh scaler")
        return
    state, skipped = broadcast_object((dict(saved), int(skipped_total)))
    scaler.load_state_dict(state)
    scaler.restore_skipped_steps(skipped)
    mine = (scaler.state_dict(), int(scaler.skipped_steps().item()))
    views = all_gather_objects(mine)
    if any(view != views[0] for view in views):
        raise RuntimeError(f"loss-scaler state differs across ranks after loading: {views}")
