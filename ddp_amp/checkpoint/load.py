"""Safe loading: weights_only unpickling, compatibility checks with hints, scaler agreement.

Nothing from a checkpoint is executed: every file goes through
`torch.load(weights_only=True)`, which accepts tensors and plain containers only. Checks
run before anything is applied, so a refused checkpoint leaves the live objects untouched.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_amp.checkpoint.discovery import resolve_resume
from ddp_amp.checkpoint.state import (META_FILE, MODEL_FILE, RNG_FILE, TRAIN_FILE, TrainingParts,
                                      restore_rng, restore_train_state)
from ddp_amp.dist import all_gather_objects, broadcast_object
from ddp_amp.errors import UsageError
from ddp_amp.scaler import AgreedGradScaler


@dataclass
class LoadedCheckpoint:
    """One checkpoint's contents, read from disk, not yet applied."""

    path: Path
    meta: dict[str, Any]
    model: dict[str, torch.Tensor]
    train: dict[str, Any]
    rng: list[dict[str, Any]]


def safe_load(path: Path) -> Any:
    """`torch.load(weights_only=True)` to the CPU; pickled code is refused with a UsageError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0][:200]
        raise UsageError("checkpoint file", str(path), "tensors and plain containers only",
                         f"it holds pickled objects or code, refused unexecuted ({reason}); "
                         "only resume from checkpoints you trust, saved by ddp_amp") from None


def read_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read every file of the checkpoint directory `path` (no collectives, no side effects)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as error:
        raise UsageError("--resume", str(path), f"a readable {META_FILE}",
                         f"{error}; every rank must see the run directory (shared filesystem)") from None
    rng = safe_load(path / RNG_FILE)
    return LoadedCheckpoint(path, meta, safe_load(path / MODEL_FILE), safe_load(path / TRAIN_FILE),
                            list(rng["ranks"]))


def check_model_shapes(path: Path, model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint of another model before touching any parameter."""
    live = model.state_dict()
    missing = sorted(set(live) - set(saved))
    extra = sorted(set(saved) - set(live))
    differ = [f"{name}: checkpoint {list(saved[name].shape)} vs model {list(tensor.shape)}"
              for name, tensor in live.items() if name in saved and saved[name].shape != tensor.shape]
    problems = differ + [f"missing {name}" for name in missing] + [f"unexpected {name}" for name in extra]
    if problems:
        raise UsageError("--resume", str(path), "a checkpoint of this model (same --task and --task-opt)",
                         f"{len(problems)} tensor(s) differ, e.g. {problems[0]}; use the options the "
                         "run was saved with, or --resume none / another --run-dir to start fresh")


def map_data_position(meta: dict[str, Any], position: dict[str, int], world_size: int,
                      micro_batch_size: int, batches_per_epoch: int) -> dict[str, int]:
    """The stream position for this world size, or UsageError if it does not map exactly.

    DistributedSampler deals one permutation out round-robin, so after j micro-batches of m
    on each of W ranks exactly the first W*j*m samples of the epoch are used. Another world
    size continues from the same sample only if W'*m' divides that count.
    """
    saved_world = int(meta["world_size"])
    if saved_world == world_size and int(meta["micro_batch_size"]) == micro_batch_size:
        return dict(position)
    epoch, batch = int(position["epoch"]), int(position["batch_in_epoch"])
    if batch >= int(meta["batches_per_epoch"]):  # at an epoch's end: the next one starts clean
        epoch, batch = epoch + 1, 0
    used = saved_world * int(meta["micro_batch_size"]) * batch
    per_batch = world_size * micro_batch_size
    if used % per_batch:
        raise UsageError("--resume", str(meta.get("path", "")) or "checkpoint",
                         f"a checkpoint whose data position maps onto {world_size} rank(s) "
                         f"({used} samples into epoch {epoch}, not a multiple of {per_batch})",
                         f"resume with {saved_world} rank(s) as saved, or pick a checkpoint at an "
                         "epoch boundary, or --resume none")
    return {"epoch": epoch, "batch_in_epoch": min(used // per_batch, batches_per_epoch)}


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
    state, skipped = broadcast_object((dict(saved), int(skipped_total)))  # type: ignore[misc]
    scaler.load_state_dict(state)
    scaler.restore_skipped_steps(skipped)
    mine = (scaler.state_dict(), int(scaler.skipped_steps().item()))
    views = all_gather_objects(mine)
    if any(view != views[0] for view in views):
        raise RuntimeError(f"loss-scaler state differs across ranks after loading: {views}")


def _agree_on_failure(failure: tuple[str, str, str, str] | None) -> None:
    """Raise the first rank's UsageError on every rank if any rank failed (collective)."""
    failures = [f for f in all_gather_objects(failure) if f]
    if failures:
        raise UsageError(*failures[0])  # type: ignore[misc]


def _as_failure(error: Exception, path: Path) -> tuple[str, str, str, str]:
    if isinstance(error, UsageError):
        return (error.what, str(error.value), error.expected, error.hint)
    reason = f"{type(error).__name__}: {error}"[:300]
    return ("--resume", str(path), "a readable ddp_amp checkpoint", reason)


def choose_checkpoint(choice: str, root: Path, rank: int, warn: Callable[[str], None]) -> Path | None:
    """Rank 0 resolves `--resume` (verifying manifests) and tells every rank (collective)."""
    chosen: str | None = None
    failure = None
    if rank == 0:
        try:
            found = resolve_resume(choice, root, warn)
            chosen = str(found) if found else None
        except UsageError as error:
            failure = _as_failure(error, root)
    _agree_on_failure(failure)
    chosen = broadcast_object(chosen)  # type: ignore[assignment]
    return Path(chosen) if chosen else None


def load_checkpoint(path: Path, parts: TrainingParts, rank: int, world_size: int, precision: str,
                    notice: Callable[[str], None]) -> tuple[int, int]:
    """Restore `parts` from checkpoint `path` on every rank; returns (step, samples_seen).

    Collective. Every rank reads the files itself (the run directory must be shared); any
    rank's refusal is raised on all ranks before anything is applied.
    """
    failure, loaded, position = None, None, {}
    try:
        loaded = read_checkpoint(path)
        check_model_shapes(path, parts.model, loaded.model)
        loaded.meta["path"] = str(path)
        position = map_data_position(loaded.meta, loaded.train["data"], world_size,
                                     parts.stream.micro_batch_size, parts.stream.batches_per_epoch)
    except (UsageError, OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
        failure = _as_failure(error, path)
    _agree_on_failure(failure)
    if loaded is None:  # unreachable: a failure was raised above; keeps type checkers honest
        raise RuntimeError(f"checkpoint {path} was not read")
    step, samples_seen = restore_train_state(parts, loaded.model, loaded.train, position)
    restore_scaler(parts.scaler, loaded.train["scaler"], int(loaded.train["scaler_skipped_total"]),
                   precision, str(loaded.meta.get("precision")), notice)
    saved_world = int(loaded.meta["world_size"])
    if saved_world != world_size:
        notice(f"checkpoint was saved with {saved_world} rank(s), resuming with {world_size}: "
               "the data position maps exactly, but the run is no longer bitwise reproducible")
    if rank < len(loaded.rng):  # each rank takes back its own RNG streams
        restore_rng(loaded.rng[rank], parts.device)
    return step, samples_seen
