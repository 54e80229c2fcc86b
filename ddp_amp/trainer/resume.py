"""Taking a run back from a checkpoint: what must fit before anything is applied, then applying it.

The Trainer's checkpoint is a `Session.save` of (checkpoints.py):
- `model`: the user's module (model.pt, unwrapped: it loads into a plain `nn.Module`);
- `optimizer` (one, or the list of a task's several), `scheduler`, `step`, `samples_seen`
  and `data`, the stream's position where it is the same on every rank (state.pt);
- per rank, `data` where each rank's position differs (an iterable dataset, a task's own
  loader) and `task_state` for a task that keeps state across steps (`Task.state`): each
  rank writes its own and reads back only its own; how many ranks saved them is the
  checkpoint's count of ranks, which a resume compares with its world size.
meta.json also holds the batch geometry, optimizer class and config, which a resume checks
before it loads any tensor. A checkpoint written by a user's own `Session.save` with a
`model` (and an `optimizer`) resumes too: what it lacks starts fresh, with a notice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_amp.data import Stream
from ddp_amp.errors import UsageError
from ddp_amp.session import Meta, SavedState, Session

# The meta.json key of the task's training data identity (Task.data_identity).
DATA_IDENTITY = "data_identity"


@dataclass
class TrainingParts:
    """The live objects a checkpoint reads from and writes into."""

    model: nn.Module  # as set up by the session (wrapped)
    optimizers: tuple[torch.optim.Optimizer, ...]  # usually one; a task may make several
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    stream: Stream
    task_state: Any = None  # Task.state: state_dict() / load_state_dict(), one per rank

    @property
    def per_rank_position(self) -> bool:
        return self.stream.per_rank_position

    def optimizer_names(self) -> str:
        """'AdamW', or 'SGD+Adam' for several: a resume compares it before loading any state."""
        return "+".join(type(optimizer).__name__ for optimizer in self.optimizers)

    def optimizer_state(self) -> Any:
        """What a checkpoint keeps of the optimizers: the one, or the list of several."""
        return self.optimizers[0] if len(self.optimizers) == 1 else list(self.optimizers)


@dataclass(frozen=True)
class Restored:
    """What `restore_training_state` put back."""

    step: int
    samples_seen: int
    meta: Meta
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


def check_model_shapes(path: Path, model: nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint of another model (`saved`: its tensors' shapes) before touching any parameter."""
    live = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()
            if isinstance(tensor, torch.Tensor)}
    missing = sorted(set(live) - set(saved))
    extra = sorted(set(saved) - set(live))
    differ = [f"{name}: checkpoint {list(saved[name])} vs model {list(shape)}"
              for name, shape in live.items() if name in saved and saved[name] != shape]
    problems = differ + [f"missing {name}" for name in missing] + [f"unexpected {name}" for name in extra]
    if problems:
        raise UsageError("--resume", str(path), "a checkpoint of this model (same --task and --task-opt)",
                         f"{len(problems)} tensor(s) differ, e.g. {problems[0]}; use the options the "
                         "run was saved with, or --resume none / another --run-dir to start fresh")


def map_data_position(meta: Mapping[str, Any], position: dict[str, int], dp_size: int,
                      micro_batch_size: int, batches_per_epoch: int, path: str = "checkpoint") -> dict[str, int]:
    """The stream position for `dp_size` data-parallel ranks, or UsageError if it does not
    map exactly.

    `meta` is the saved batch geometry: world_size, micro_batch_size, batches_per_epoch.

    The stream deals each epoch's order out per micro-step (data/batches.py), so after j
    micro-batches of m on each of W data-parallel ranks exactly the first W*j*m samples of the
    epoch's order are used.
    Another number of ranks continues from the same sample only if W'*m' divides that count.
    A checkpoint without `dp_size` in its meta was saved where every rank was data parallel.
    """
    saved_world = int(meta.get("dp_size", meta["world_size"]))
    if saved_world == dp_size and int(meta["micro_batch_size"]) == micro_batch_size:
        return dict(position)
    epoch, batch = int(position["epoch"]), int(position["batch_in_epoch"])
    if batch >= int(meta["batches_per_epoch"]):  # at an epoch's end: the next one starts clean
        epoch, batch = epoch + 1, 0
    used = saved_world * int(meta["micro_batch_size"]) * batch
    per_batch = dp_size * micro_batch_size
    if used % per_batch:
        raise UsageError("--resume", path,
                         f"a checkpoint whose data position maps onto {dp_size} rank(s) "
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


@dataclass(frozen=True)
class _Fit:
    """What the checks decided, the same on every rank."""

    position: dict[str, Any] | None  # this rank's data position; None: start at the data's beginning
    optimizer: bool  # load the saved optimizer state


def _fits(saved: SavedState, parts: TrainingParts, world_size: int, dp_size: int,
          optimizer_may_change: bool) -> _Fit:
    """Check, on every rank, that `saved` resumes this run; raise UsageError where it does not."""
    path = saved.path
    check_model_shapes(path, Session.unwrap(parts.model), saved.shapes("model"))
    optimizer = saved.holds("optimizer") and _optimizer_fits(path, saved.meta.optimizer_class,
                                                             parts.optimizer_names(), optimizer_may_change)
    for key in ("data", "task_state"):
        if key in saved.per_rank_keys and saved.per_rank_ranks != world_size:
            what = "the task keeps state per rank (Task.state)" if key == "task_state" else \
                "the data position is per rank (an iterable dataset, Task.make_loader)"
            raise UsageError("--resume", str(path), f"a checkpoint of {world_size} rank(s), as {what}; it was "
                             f"saved by {saved.per_rank_ranks}", "resume with the world size it was saved "
                             "with, or --resume none")
    if parts.per_rank_position:
        if "data" not in saved.per_rank_keys:
            raise UsageError("--resume", str(path), f"a checkpoint of {world_size} rank(s), as the data position "
                             "is per rank (an iterable dataset, Task.make_loader); it was saved by another kind "
                             "of dataset", "resume with the data it was saved with, or --resume none")
        return _Fit(saved.per_rank["data"], optimizer)  # this rank's own, the only one it read
    position = saved.values.get("data")
    if position is None:  # written by a loop of the user's own: no position to map
        return _Fit(None, optimizer)
    stream = parts.stream
    geometry = {"world_size": saved.world_size, "dp_size": saved.meta.dp_size or saved.world_size,
                "micro_batch_size": saved.meta.micro_batch_size, "batches_per_epoch": saved.meta.batches_per_epoch}
    return _Fit(map_data_position(geometry, position, dp_size, stream.micro_batch_size,
                                  # a shared position is a map-style shard's, whose pass length is known
                                  stream.batches_per_epoch, str(path)), optimizer)  # type: ignore[arg-type]  # known, as said above


def restore_training_state(session: Session, path: Path, parts: TrainingParts, notice: Callable[[str], None],
                           optimizer_may_change: bool = False) -> Restored:
    """Restore `parts`, the scaler and this rank's RNG from checkpoint `path` (collective).

    Any rank's refusal (unreadable, another model or optimizer, a data position that does
    not map onto this world) is raised on every rank before anything is applied.
    """
    world_size, dp_size = session.world_size, session.ctx.dp_size
    saved, fit = session.read(path, lambda saved: _fits(saved, parts, world_size, dp_size, optimizer_may_change))
    if fit is None:  # read gives the check's answer whenever it is given a check
        raise RuntimeError(f"reading {path} gave no answer of its check")
    state: dict[str, Any] = {"model": parts.model}
    if fit.optimizer:
        state["optimizer"] = parts.optimizer_state()
    elif saved.holds("optimizer"):
        notice(f"the optimizer changed from {saved.meta.optimizer_class} to {parts.optimizer_names()} "
               "(--allow-change optimizer): it starts fresh")
    if parts.scheduler is not None and saved.values.get("scheduler") is not None:
        state["scheduler"] = parts.scheduler
    if parts.task_state is not None and "task_state" in saved.per_rank_keys:
        state["task_state"] = _OnDevice(parts.task_state, session)
    elif parts.task_state is not None:
        notice("the checkpoint holds no task state (Task.state): the task's state starts fresh")
    values = session.restore(saved, state, notice=notice)
    if fit.position is not None:
        parts.stream.load_state_dict(fit.position)
    else:
        notice(f"{path} holds no data position (not saved by the Trainer): the data starts from its beginning")
    if saved.world_size != world_size:
        notice(f"checkpoint was saved with {saved.world_size} rank(s), resuming with {world_size}: "
               "the data position maps exactly, but the run is no longer bitwise reproducible")
    return Restored(int(values.get("step", 0)), int(values.get("samples_seen", 0)), saved.meta,
                    bool(fit.optimizer))


class _OnDevice:
    """A task's state loaded with its tensors moved to the run's device (saved on the CPU)."""

    def __init__(self, state: Any, session: Session) -> None:
        self.state, self.session = state, session

    def load_state_dict(self, saved: Any) -> None:
        self.state.load_state_dict(self.session.to_device(saved))
