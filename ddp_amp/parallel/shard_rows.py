"""What a parameter holds while a model is built sharded (`meta_init`): this rank's rows.

`ShardSlot` says which rows are this rank's (those `fully_shard`'s `Shard(0)` gives it).
`BuildValues` holds them for a parameter and every alias of it; the one parameter whose
init code is running (the build's current one) holds its full values as well, or a fill of
it (`Fill`) whose rows alone were computed and which is made again in full only if init
code reads it. Everything large lives in memory mappings of its own (`host_pages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ddp_amp.parallel.host_pages import mapped_copy, mapped_empty
from ddp_amp.parallel.init_skip import SkipPlan
from ddp_amp.parallel.row_draws import FILLS, PIECE, fill_rows, replay


def _chunk(extent: int, parts: int, index: int) -> tuple[int, int]:
    """`[start, stop)` of chunk `index` of `parts` along an extent, as `torch.chunk` cuts it
    (chunks of ceil(extent / parts); the last ones may be short or empty)."""
    size = -(-extent // parts) if extent else 0
    start = min(index * size, extent)
    return start, min(start + size, extent)


@dataclass(frozen=True)
class ShardSlot:
    """Where this rank's part of a parameter lies: first chunk `split_index` of `split` along
    dimension `split_dim` (tensor parallel's cut; none where `split_dim` is None), then chunk
    `index` of `size` along dimension 0 of that (FSDP2's `Shard(0)` of the split tensor)."""

    size: int = 1
    index: int = 0
    split: int = 1
    split_index: int = 0
    split_dim: int | None = None

    def region(self, shape: torch.Size) -> tuple[slice, ...]:
        """The part's extent along each dimension of a full tensor of `shape`."""
        bounds = [(0, extent) for extent in shape]
        if self.split_dim is not None and self.split > 1:
            bounds[self.split_dim] = _chunk(shape[self.split_dim], self.split, self.split_index)
        if bounds:
            low, high = bounds[0]
            first, last = _chunk(high - low, self.size, self.index)
            bounds[0] = (low + first, low + last)
        return tuple(slice(low, high) for low, high in bounds)

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full` (a view), as the split and `fully_shard` leave it (possibly none)."""
        if full.dim() == 0:
            return full
        return full[self.region(full.shape)]

    def flat_ranges(self, shape: torch.Size) -> list[tuple[int, int]]:
        """Where the part lies in a contiguous tensor of `shape`, flattened: `[start, stop)`
        runs in order, one for a part of whole rows, one per row of a part of columns."""
        if not shape:
            return [(0, 1)]
        region = self.region(shape)
        last = max((dim for dim, cut in enumerate(region) if cut.stop - cut.start != shape[dim]), default=0)
        run = math.prod(cut.stop - cut.start for cut in region[last:])
        strides = [math.prod(shape[dim + 1:]) for dim in range(len(shape))]
        starts = [region[last].start * strides[last]]
        for dim in range(last - 1, -1, -1):
            starts = [base + at * strides[dim] for at in range(region[dim].start, region[dim].stop) for base in starts]
        return [(start, start + run) for start in sorted(starts) if run]


def shard_slot(mesh: DeviceMesh) -> ShardSlot:
    """This rank's slot on the mesh's sharding dimension (replicas of HSDP share a slot), the
    innermost data-parallel one of the mesh FSDP2 spreads the model over (`DistContext.spread_mesh`)."""
    names = mesh.mesh_dim_names or ()
    dim = next((names.index(name) for name in ("dp_shard_cp", "dp_shard", "dp_cp", "dp") if name in names), 0)
    return ShardSlot(mesh.size(dim), mesh.get_local_rank(dim))


def split_slot(slot: ShardSlot, mesh: DeviceMesh, split_dim: int | None) -> ShardSlot:
    """`slot` with the mesh's tensor-parallel cut along `split_dim` first (None: not split)."""
    names = mesh.mesh_dim_names or ()
    if split_dim is None or "tp" not in names:
        return slot
    dim = names.index("tp")
    return replace(slot, split=mesh.size(dim), split_index=mesh.get_local_rank(dim), split_dim=split_dim)


class SlotBuild:
    """One build's state: the one tensor whose init code is running (held in full, or as a
    fill it can replay), and a scratch piece per dtype for fills drawn piece by piece."""

    def __init__(self, slot: ShardSlot, plan: SkipPlan | None = None,
                 slots: Sequence[ShardSlot] | None = None) -> None:
        self.slot, self.plan, self.slots = slot, plan, slots
        self.current: BuildValues | None = None
        self.registered = 0  # parameters registered so far (the plan's index)
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def slot_for(self, index: int) -> ShardSlot:
        """The slot of registration `index`: its own where the build was given one per
        registration (a split model's parameters are cut along different dimensions)."""
        if self.slots is not None and index < len(self.slots):
            return self.slots[index]
        return self.slot

    def scratch(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        held = self._scratch.get(dtype)
        if held is None or held.numel() < min(numel, PIECE + 15):
            held = self._scratch[dtype] = mapped_empty((min(numel, PIECE + 15),), dtype)
        return held

    def finish(self) -> None:
        if self.current is not None:
            self.current.cut()
        self._scratch.clear()


class BuildValues:
    """What a parameter (and every alias of it) holds: this rank's rows, and while it is the
    build's current tensor, the full tensor too, or the fill that made it (`Fill`): its rows
    were drawn piece by piece, and the full tensor is made again only if init code reads it."""

    def __init__(self, build: SlotBuild, rows: torch.Tensor, label: str, part: bool = False,
                 skipped: bool = False, slot: ShardSlot | None = None) -> None:
        self.build, self.rows, self.label = build, rows, label
        self.slot = slot if slot is not None else build.slot  # where its part lies
        self.full: torch.Tensor | None = None
        self.fill: Fill | None = None
        # A view of a part of a parameter (a row, a column) no longer held in full: its
        # elements are not this rank's rows, so any write into it is refused.
        self.part = part
        # Left uninitialised (zeros), writes ignored: a load overwrites it (init_skip.py).
        self.skipped = skipped

    def _become_current(self) -> None:
        if self.build.current is not None and self.build.current is not self:
            self.build.current.cut()
        self.build.current = self

    def start_full(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Hold this tensor in full from now on (its old values are about to be overwritten)."""
        if self.full is None:
            self._become_current()
            self.fill = None
            self.full = mapped_empty(shape, dtype)
        return self.full

    def fill_rows(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], shape: torch.Size,
                  dtype: torch.dtype) -> None:
        """Overwrite the whole tensor with a fill (a constant, or random: row_draws.py), computing
        only this rank's rows of it."""
        self._become_current()
        self.full = None
        state = None
        if func.overloadpacket.__name__ in FILLS:
            numel = math.prod(shape)
            state = fill_rows(func, args, kwargs, numel, dtype, self.slot.flat_ranges(shape),
                              self.rows.view(-1), self.build.scratch(dtype, numel))
        else:
            func(self.rows, *args, **kwargs)
        self.fill = Fill(func, args, kwargs, state)

    def full_values(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The full tensor, made again from its fill if only that is held."""
        if self.full is None and self.fill is not None:
            fill, self.fill = self.fill, None
            self.full = replay(fill.func, fill.args, fill.kwargs, fill.state, mapped_empty(shape, dtype))
        if self.full is None:  # callers check _in_full first
            raise RuntimeError(f"{self.label}: its full values are not held here")
        return self.full

    def cut(self) -> None:
        """Keep the rows of the full tensor and let the rest go (a fill's rows are kept already)."""
        if self.full is not None:
            self.rows.copy_(self.slot.rows(self.full))
        self.full = self.fill = None
        self.build.current = None

    def __deepcopy__(self, memo: dict[int, Any]) -> BuildValues:
        # `copy.deepcopy` of a parameter copies its attributes too: a copy of the values, in the same build.
        return self.copied()

    def copied(self) -> BuildValues:
        source = self.slot.rows(self.full) if self.full is not None else self.rows
        return BuildValues(self.build, mapped_copy(source), self.label, skipped=self.skipped, slot=self.slot)


@dataclass(frozen=True)
class Fill:
    """A fill whose rows alone were computed: a constant's, or a random one's drawn piece by
    piece, with the generator state it started from."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: torch.Tensor | None
