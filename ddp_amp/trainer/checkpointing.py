"""What the Trainer puts into a checkpoint and how it takes it back out.

Files, besides the `rng.pt` and `meta.json` that every checkpoint has (all loadable with
`torch.load(weights_only=True)`):
- `model.pt`: the user's module's `state_dict()` (no DDP `module.` / wrapper prefixes), so
  it loads into a plain `nn.Module`;
- `train.pt`: optimizer (a list, for a task with several), scaler (+ its skipped-step count),
  scheduler, step, samples seen
  and the data position;
- `task_state.pt`, for a task that keeps state across steps (`Task.state`, e.g. a carried
  hidden state): every rank's `state_dict()`, in rank order, on the CPU;
- `data.pt`, for an iterable dataset, whose position differs per rank: every rank's
  (train.pt's `data` is then None).
`meta.json` also holds the batch geometry, precision and config, which a resume checks
before it loads any tensor. Saving and loading themselves are `ddp_amp.checkpoint`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ddp_amp.amp import AgreedGradScaler
from ddp_amp.checkpoint import LoadedCheckpoint, read_agreed, restore_own_rng, restore_scaler
from ddp_amp.distributed import all_gather_objects, to_device
from ddp_amp.errors import UsageError
from ddp_amp.trainer.loader_stream import LoaderStream
from ddp_amp.trainer.stream import BatchStream

MODEL_FILE, TRAIN_FILE, TASK_STATE_FILE, DATA_FILE = "model.pt", "train.pt", "task_state.pt", "data.pt"


@dataclass
class TrainingParts:
    """The live objects a checkpoint reads from and writes into."""

    model: nn.Module  # the user's module, unwrapped
    optimizers: tuple[torch.optim.Optimizer, ...]  # usually one; a task may make several
    scaler: AgreedGradScaler
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    stream: BatchStream | LoaderStream
    device: torch.device
    task_state: Any = None  # Task.state: state_dict() / load_state_dict(), one per rank


def _optimizer_states(parts: TrainingParts) -> Any:
    """One optimizer's state_dict, or the list of several (in the task's order)."""
    states = [optimizer.state_dict() for optimizer in parts.optimizers]
    return states[0] if len(states) == 1 else states


def _optimizer_names(parts: TrainingParts) -> str:
    """'AdamW', or 'SGD+Adam' for several: a resume compares it before loading any state."""
    return "+".join(type(optimizer).__name__ for optimizer in parts.optimizers)


def _per_rank(parts: TrainingParts) -> bool:
    return getattr(parts.stream, "per_rank_position", False)


def training_files(parts: TrainingParts, step: int, samples_seen: int) -> dict[str, Any]:
    """The Trainer's files of a checkpoint at `step` (collective where the task keeps state:
    every rank's is gathered)."""
    files = {
        MODEL_FILE: parts.model.state_dict(),
        TRAIN_FILE: {
            "optimizer": _optimizer_states(parts),
            "scaler": parts.scaler.state_dict(),
            "scaler_skipped_total": int(parts.scaler.skipped_steps().item()),
            "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
            "step": step,
            "samples_seen": samples_seen,
            "data": None if _per_rank(parts) else parts.stream.state_dict(),
        },
    }
    if _per_rank(parts):
        files[DATA_FILE] = {"ranks": all_gather_objects(parts.stream.state_dict())}
    if parts.task_state is not None:
        own = tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                       parts.task_state.state_dict())
        files[TASK_STATE_FILE] = {"ranks": all_gather_objects(own)}
    return files


def run_meta(config: dict[str, Any], parts: TrainingParts, precision: str, step: int) -> dict[str, Any]:
    """What a resume checks compatibility against before loading tensors (into meta.json)."""
    return {"step": step, "micro_batch_size": parts.stream.micro_batch_size,
            "batches_per_epoch": parts.stream.batches_per_epoch, "precision": precision,
            "loss_scaling": parts.scaler.is_enabled(), "optimizer_class": _optimizer_names(parts),
            "config": config}


@dataclass(frozen=True)
class Restored:
    """What `load_training_state` put back."""

    step: int
    samples_seen: int
    meta: dict[str, Any]
    optimizer_loaded: bool  # False where the optimizer changed and starts fresh


def scale_learning_rates(optimizer: torch.optim.Optimizer,
                         scheduler: torch.optim.lr_scheduler.LRScheduler | None, factor: float) -> None:
    """Multiply every learning rate the optimizer and its scheduler hold by `factor`.

    A scheduler computes from its base rates (and the groups' `initial_lr`), so those are
    scaled too; the ratios between param groups stay as they were.
    """
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):  # ReduceLROnPlateau has none
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


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
                      micro_batch_size: int, batches_per_epoch: int, path: str = "checkpoint") -> dict[str, int]:
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
        raise UsageError("--resume", path,
                         f"a checkpoint whose data position maps onto {world_size} rank(s) "
                         f"({used} samples into epoch {epoch}, not a multiple of {per_batch})",
                         f"resume with {saved_world} rank(s) as saved, or pick a checkpoint at an "
                         "epoch boundary, or --resume none")
    return {"epoch": epoch, "batch_in_epoch": min(used // per_batch, batches_per_epoch)}


def _optimizer_fits(path: Path, saved: str | None, live: str, may_change: bool) -> bool:
    """Whether the saved optimizer state loads into this run's optimizer; refuses a mismatch."""
    if saved is None or saved == live:
        return True
    if may_change:
        return False
    raise UsageError("--resume", str(path), f"a checkpoint of a {live} optimizer (this run's)",
                     f"its optimizer state is {saved}'s and does not load into {live}; resume with the "
                     f"saved --optimizer, or add --allow-change optimizer to start {live} fresh")


def load_training_state(path: Path, parts: TrainingParts, rank: int, world_size: int, precision: str,
                        notice: Callable[[str], None], optimizer_may_change: bool = False) -> Restored:
    """Restore `parts` and this rank's RNG from checkpoint `path`.

    Collective. Any rank's refusal (unreadable, another model or optimizer, a data position
    that does not map onto this world) is raised on every rank before anything is applied.
    """
    live_optimizer = _optimizer_names(parts)

    def fits(loaded: LoadedCheckpoint) -> tuple[dict[str, int], bool]:
        check_model_shapes(path, parts.model, loaded.files[MODEL_FILE])
        optimizer_fits = _optimizer_fits(path, loaded.meta.get("optimizer_class"), live_optimizer,
                                         optimizer_may_change)
        if _per_rank(parts):  # each rank's own, from data.pt (state_fits checked it is there)
            return loaded.files[DATA_FILE]["ranks"][rank], optimizer_fits
        position = map_data_position(loaded.meta, loaded.files[TRAIN_FILE]["data"], world_size,
                                     parts.stream.micro_batch_size, parts.stream.batches_per_epoch, str(path))
        return position, optimizer_fits

    with_state = parts.task_state is not None and (path / TASK_STATE_FILE).is_file()
    per_rank = [name for name, present in ((TASK_STATE_FILE, with_state), (DATA_FILE, _per_rank(parts))) if present]

    def state_fits(loaded: LoadedCheckpoint) -> tuple[dict[str, int], bool]:
        for name in per_rank:
            saved = loaded.files.get(name)
            if saved is None or len(saved["ranks"]) != world_size:
                what = "the task keeps state per rank (Task.state)" if name == TASK_STATE_FILE else \
                    "the data position is per rank (an iterable dataset, Task.make_loader)"
                raise UsageError("--resume", str(path), f"a checkpoint of {world_size} rank(s), as {what}; it was "
                                 f"saved by {len(saved['ranks']) if saved else 'another kind of dataset'}",
                                 "resume with the world size it was saved with, or --resume none")
        return fits(loaded)

    names = (MODEL_FILE, TRAIN_FILE) + tuple(name for name in per_rank if (path / name).is_file())
    loaded, (position, optimizer_fits) = read_agreed(path, names, state_fits)
    state = loaded.files[TRAIN_FILE]
    parts.model.load_state_dict(loaded.files[MODEL_FILE])
    if optimizer_fits:
        saved_states = state["optimizer"] if len(parts.optimizers) > 1 else [state["optimizer"]]
        for optimizer, saved in zip(parts.optimizers, saved_states):
            optimizer.load_state_dict(saved)
    else:
        notice(f"the optimizer changed from {loaded.meta['optimizer_class']} to {live_optimizer} "
               "(--allow-change optimizer): it starts fresh")
    if parts.scheduler is not None and state["scheduler"] is not None:
        parts.scheduler.load_state_dict(state["scheduler"])
    parts.stream.load_state_dict(position)
    restore_scaler(parts.scaler, state["scaler"], int(state["scaler_skipped_total"]),
                   precision, str(loaded.meta.get("precision")), notice)
    saved_world = int(loaded.meta["world_size"])
    if saved_world != world_size:
        notice(f"checkpoint was saved with {saved_world} rank(s), resuming with {world_size}: "
               "the data position maps exactly, but the run is no longer bitwise reproducible")
    if with_state:
        parts.task_state.load_state_dict(to_device(loaded.files[TASK_STATE_FILE]["ranks"][rank], parts.device))
    elif parts.task_state is not None:
        notice("the checkpoint holds no task state (Task.state): the task's state starts fresh")
    restore_own_rng(loaded, rank, parts.device)
    return Restored(int(state["step"]), int(state["samples_seen"]), loaded.meta, optimizer_fits)
