"""Whole documents into windows: best-fit decreasing, computed once per split and window size.

The algorithm (TRL's default `bfd` strategy and Megatron's packed SFT do the same kind):
documents longer than a window are cut to one (`keep_start` keeps their start, `keep_end`
their end) or dropped (`drop`); a document whose kept part has no target (a conversation
whose assistant turns lie past the cut, say) is dropped too, as TRL drops an example that
truncation left fully masked: it would only fill a window the loss does not look at. The
rest are taken longest first, and each goes into the open window whose free room is the
smallest that still holds it, or opens a new window. A segment tree over the free-room values
(0..window) answers "the smallest room >= n" in O(log window), so packing D documents costs
O(D log window) time and O(D) memory, once: the plan is kept in the cache entry beside the
split (plan_store.py: `<split>.bfd-<window>-<mode>.*`) and memory-mapped by every rank after
that. docs/data.md gives the fill rates measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddp_amp.data.plan_store import PlanArrays

TRUNCATION_MODES = ("keep_start", "keep_end", "drop")


class _RoomTree:
    """Counts of open windows per free room, with "smallest room >= n that has one"."""

    def __init__(self, capacity: int) -> None:
        self.size = 1 << max(1, capacity).bit_length()
        self.counts = [0] * (2 * self.size)

    def add(self, room: int, delta: int) -> None:
        node = room + self.size
        while node:
            self.counts[node] += delta
            node >>= 1

    def smallest_at_least(self, need: int) -> int | None:
        counts, size = self.counts, self.size
        node = need + size
        if counts[node]:
            return need
        while node > 1:  # climb until a right sibling has an open window, then descend leftmost
            if node & 1 == 0 and counts[node + 1]:
                node += 1
                while node < size:
                    node = 2 * node if counts[2 * node] else 2 * node + 1
                return node - size
            node >>= 1
        return None


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The window of each item (sizes <= capacity, > 0), windows numbered from 0."""
    tree = _RoomTree(capacity)
    rooms: dict[int, list[int]] = {}  # free room -> open windows with that room
    window_of = np.empty(len(sizes), dtype=np.int64)
    opened = 0
    for item in np.argsort(-sizes, kind="stable").tolist():
        need = int(sizes[item])
        room = tree.smallest_at_least(need)
        if room is None:
            window, room = opened, capacity
            opened += 1
        else:
            window = rooms[room].pop()
            tree.add(room, -1)
        window_of[item] = window
        left = room - need
        rooms.setdefault(left, []).append(window)
        tree.add(left, 1)
    return window_of


@dataclass(frozen=True)
class PackStats:
    documents: int  # packed
    windows: int
    truncated: int  # packed, cut to a window
    dropped: int  # longer than a window, under mode "drop"
    untrained: int  # dropped: no target in the part a window would keep
    fill: float  # tokens placed / (windows x window size)


def kept_spans(offsets: np.ndarray, capacity: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Each document's part a window keeps, [low, high) in the split's tokens (`offsets`: the
    documents' starts and the end; a document longer than `capacity` keeps its start or its end)."""
    starts, stops = np.asarray(offsets[:-1], np.int64), np.asarray(offsets[1:], np.int64)
    kept = np.minimum(stops - starts, capacity)
    return (stops - kept, stops) if mode == "keep_end" else (starts, starts + kept)


def build_plan(lengths: np.ndarray, capacity: int, mode: str,
               trained: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], PackStats]:
    """Pack documents of `lengths` into windows of `capacity` tokens: the plan's arrays (`docs`:
    the documents window by window; `bounds`: where each window's run of them starts) and its
    stats. `trained[d]`: whether document d's kept part holds a target (None: every one does)."""
    ids = np.arange(len(lengths), dtype=np.int64)
    keep = lengths > 0
    if mode == "drop":
        keep &= lengths <= capacity
    untrained = 0
    if trained is not None:
        untrained = int((keep & ~trained).sum())
        keep &= trained
    sizes = np.minimum(lengths[keep], capacity)
    window_of = best_fit_decreasing(sizes, capacity) if len(sizes) else np.zeros(0, dtype=np.int64)
    order = np.argsort(window_of, kind="stable")
    windows = int(window_of.max()) + 1 if len(window_of) else 0
    bounds = np.searchsorted(window_of[order], np.arange(windows + 1)).astype(np.uint64)
    over = lengths > capacity
    stats = PackStats(int(keep.sum()), windows, int((over & keep).sum()) if mode != "drop" else 0,
                      int(over.sum()) if mode == "drop" else 0, untrained,
                      float(sizes.sum()) / max(windows * capacity, 1))
    return {"docs": ids[keep][order].astype(np.uint64), "bounds": bounds}, stats


class PackPlan:
    """A plan's windows: which documents each holds (arrays memory-mapped or held: plan_store.py)."""

    def __init__(self, arrays: PlanArrays, capacity: int, mode: str) -> None:
        self.arrays, self.capacity, self.mode = arrays, capacity, mode
        self.windows = len(arrays["bounds"]) - 1

    def documents_of(self, window: int) -> list[int]:
        bounds = self.arrays["bounds"]
        return self.arrays["docs"][int(bounds[window]):int(bounds[window + 1])].astype(np.int64).tolist()

    def kept(self, start: int, stop: int) -> tuple[int, int]:
        """The part of a document [start, stop) its window holds."""
        if stop - start <= self.capacity:
            return start, stop
        return (start, start + self.capacity) if self.mode == "keep_start" else (stop - self.capacity, stop)
