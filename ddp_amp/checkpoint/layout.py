"""The one checkpoint layout: what `Session.save` writes, and so what the Trainer writes too.

    <checkpoint>/
      model.pt       each module of the state in a file of its own, named by its key:
                     its `state_dict()`, unwrapped (no DDP `module.` or wrapper prefixes),
                     so it loads into the plain `nn.Module`
      state.pt       everything else of the state: each optimizer's and other object's
                     `state_dict()`, plain values (numbers, strings, paths, containers),
                     and the loss scaler's state under the reserved key "scaler"
      meta.json      who saved it, world size, versions, precision, which files are modules
                     and which keys per-rank, and the caller's own description
      rng/rank-00000.pt    each rank's RNG states, a file per rank, written and read by that rank
      per_rank/rank-00000.pt  each rank's values of the per-rank entries ({key: value}), a
                     file per rank, written and read by that rank (rank_values.py)
      sharded/       a sharded state's DCP shards (`__<rank>_<n>.distcp`, each rank its
                     own) and their map (`.metadata`, rank 0's); see sharded.py
      ranks/rank-00000.json  each rank's record: size and sha256 of the files it wrote
                     (its RNG file, its per-rank values, its shards), written by that rank
                     (rank_files.py)
      manifest.json  size and sha256 of rank 0's files, and one digest over the ranks'
                     records, written last: the checkpoint is complete exactly when it
                     verifies. A resume checks on each rank only the files that rank reads
                     (verify.py)

`python -m ddp_amp.export` takes a module's file from here, `--resume` and `Session.load`
read it all. Older layouts still load: the Trainer's `train.pt` (today's `state.pt`,
with the scaler's skipped-step count inside), a Session's `state.pt` that held the
modules' state dicts among its values, one `rng.pt` holding every rank's RNG states, each
per-rank entry in a file of rank 0's with every rank's value (`data.pt`: {"ranks": [rank 0's,
...]}), and a manifest of format 1 that lists every rank's files itself (no `ranks/`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ddp_amp.amp import unwrap_model
from ddp_amp.checkpoint.load import LoadedCheckpoint
from ddp_amp.checkpoint.meta import Meta
from ddp_amp.checkpoint.sharded import sharded_shapes
from ddp_amp.errors import UsageError

STATE_FILE = "state.pt"
LEGACY_STATE_FILE = "train.pt"  # the Trainer's name for state.pt before there was one layout
SCALER_KEY = "scaler"
_RESERVED = frozenset({"state", "train", "rng", "meta", "manifest"})
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def module_file(key: str) -> str:
    return f"{key}.pt"


def check_keys(state: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
    """Refuse keys that cannot name a file of the layout, or that it reserves."""
    for key in [*state, *per_rank]:
        if not isinstance(key, str) or not _KEY.match(key) or key in _RESERVED:
            raise UsageError("state key", key, "a plain name (letters, digits, _ . -) other than "
                             + ", ".join(sorted(_RESERVED)), "rename it, e.g. 'model' or 'optimizer'")
    if SCALER_KEY in state or SCALER_KEY in per_rank:
        raise UsageError("state key", SCALER_KEY, "a key other than the reserved one",
                         "the session saves its scaler under it; rename yours")
    both = sorted(set(state) & set(per_rank))
    if both:
        raise UsageError("state key", both[0], "a key in either state or per_rank, not both", "rename one of them")


def state_of(value: Any) -> Any:
    """What a value of the state is saved as: its `state_dict()` if it has one (a module's
    unwrapped), a list of them for a list of such objects (several optimizers), else the
    value itself."""
    if isinstance(value, nn.Module):
        return unwrap_model(value).state_dict()
    if hasattr(value, "state_dict"):
        return value.state_dict()
    if isinstance(value, (list, tuple)) and value and all(hasattr(item, "state_dict") for item in value):
        return [item.state_dict() for item in value]
    return value


# An optimizer's choice of kernels, in each param group: this run's, whatever a checkpoint says
# (its state loads into any of them; a fused SGD has no form for sharded parameters, say).
KERNEL_OPTIONS = ("fused", "foreach")


def keeping_kernels(optimizers: Sequence[Any], load: Callable[[], None]) -> None:
    """Run `load` (a state load into `optimizers`), then give their groups back their kernels."""
    kept = [[{key: group[key] for key in KERNEL_OPTIONS if key in group} for group in optimizer.param_groups]
            for optimizer in optimizers]
    load()
    for optimizer, groups in zip(optimizers, kept, strict=True):
        for group, options in zip(optimizer.param_groups, groups):
            group.update(options)


def load_into(obj: Any, saved: Any) -> None:
    """Put a saved state back into `obj` (what `state_of` took from it)."""
    if isinstance(obj, nn.Module):
        unwrap_model(obj).load_state_dict(saved)
    elif isinstance(obj, torch.optim.Optimizer):
        keeping_kernels([obj], lambda: obj.load_state_dict(saved))
    elif hasattr(obj, "load_state_dict"):
        obj.load_state_dict(saved)
    elif isinstance(obj, (list, tuple)) and all(hasattr(item, "load_state_dict") for item in obj):
        for item, state in zip(obj, saved, strict=True):
            load_into(item, state)


def layout_files(state: Mapping[str, Any], scaler_state: dict[str, Any],
                 per_rank: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0's files of a checkpoint of `state` (modules in their own files) and what
    meta.json records about them, with the keys of the `per_rank` entries (each rank writes
    its own values of those, rank_values.py)."""
    modules = sorted(key for key, value in state.items() if isinstance(value, nn.Module))
    files: dict[str, Any] = {module_file(key): state_of(state[key]) for key in modules}
    values = {key: state_of(value) for key, value in state.items() if key not in modules}
    files[STATE_FILE] = {**values, SCALER_KEY: scaler_state}
    return files, {"modules": modules, "per_rank": sorted(per_rank)}


@dataclass
class SavedState:
    """A checkpoint in this layout, read from disk and checked, not yet applied."""

    path: Path
    meta: Meta
    values: dict[str, Any]  # state.pt, the scaler's entry included
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> state dict
    per_rank: dict[str, Any] = field(default_factory=dict)  # key -> the reading rank's own value
    rng: dict[int, dict[str, Any]] = field(default_factory=dict)  # the reading rank's RNG states, by rank
    rng_ranks: int = 0  # how many ranks' RNG states the checkpoint holds
    per_rank_keys: tuple[str, ...] = ()  # every per-rank entry, the reading rank's value or not
    per_rank_ranks: int = 0  # how many ranks saved a value of each per-rank entry

    @property
    def sharded(self) -> list[str]:
        """The entries written sharded, under sharded/ (a sharded model and its optimizer)."""
        return list(self.meta.sharded)

    @property
    def world_size(self) -> int:
        return self.meta.world_size if self.meta.world_size is not None else (self.rng_ranks or 1)

    @property
    def scaler_skipped_total(self) -> int:
        # In meta.json since there is one layout; inside the Trainer's old train.pt before.
        if self.meta.scaler_skipped_total is not None:
            return self.meta.scaler_skipped_total
        return int(self.values.get("scaler_skipped_total", 0))

    def holds(self, key: str) -> bool:
        return key in self.modules or key in self.values or key in self.per_rank_keys or key in self.sharded

    def saved_per_rank(self, key: str, world_size: int) -> bool:
        """Whether `key` is a per-rank entry; UsageError where it is one but was saved by
        another number of ranks than `world_size` (each rank's value is its rank's alone)."""
        if key not in self.per_rank_keys:
            return False
        if self.per_rank_ranks != world_size:
            raise UsageError("checkpoint key", key, f"a per-rank entry saved by {world_size} rank(s)",
                             f"it was saved by {self.per_rank_ranks}; resume with that many ranks")
        return True

    def value(self, key: str) -> Any:
        """The saved state of `key`: a module's state dict, another object's, or a plain value."""
        if key in self.modules:
            return self.modules[key]
        if key in self.values:
            return self.values[key]
        raise UsageError("checkpoint key", key, f"one of {sorted(self.keys())}",
                         "save it first, or leave it out of the load")

    def keys(self) -> list[str]:
        return sorted({*self.modules, *self.values, *self.per_rank_keys, *self.sharded} - {SCALER_KEY})

    def shapes(self, key: str) -> dict[str, tuple[int, ...]]:
        """Each tensor's (global) shape in module entry `key`, read from the map alone where sharded."""
        if key in self.sharded:
            return sharded_shapes(self.path, key)
        return {name: tuple(tensor.shape) for name, tensor in self.value(key).items() if isinstance(tensor, Tensor)}


def saved_state(loaded: LoadedCheckpoint) -> SavedState:
    """The files read by `checkpoint.read_checkpoint` as a SavedState."""
    state_name = STATE_FILE if STATE_FILE in loaded.files else LEGACY_STATE_FILE
    values = dict(loaded.files.get(state_name) or {})
    # Older checkpoints keep each per-rank entry in a file of every rank's values, read whole.
    # meta.json names them; before it did, they were the Trainer's two.
    legacy_keys = set() if loaded.own_ranks else \
        set(loaded.meta.per_rank if loaded.meta.per_rank is not None else ("data", "task_state"))
    modules, every_rank = {}, {}
    for name, payload in loaded.files.items():
        key = name.removesuffix(".pt")
        if name == state_name:
            continue
        if key in legacy_keys:
            every_rank[key] = list(payload["ranks"])
        else:
            modules[key] = payload
    if loaded.own_ranks:  # each rank wrote its own values, and read them back alone
        own, keys, ranks = dict(loaded.own), tuple(loaded.meta.per_rank or ()), loaded.own_ranks
    else:
        rank = loaded.rank
        own = {key: saved[rank] for key, saved in every_rank.items() if rank is not None and rank < len(saved)}
        keys, ranks = tuple(sorted(every_rank)), max((len(saved) for saved in every_rank.values()), default=0)
    return SavedState(loaded.path, loaded.meta, values, modules, own, loaded.rng, loaded.rng_ranks, keys, ranks)
