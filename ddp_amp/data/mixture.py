"""Several sources' windows as one dataset, each used WEIGHT times per epoch.

A source of n windows with weight w contributes round(w n) items to an epoch: its windows
once each for every whole pass, and for the fraction left a seeded choice of them that
changes from epoch to epoch (the stream calls `set_epoch`), so a source weighted 0.5 shows
half its windows each epoch and all of them over two. The stream's order then shuffles the
whole mixture. Nothing is indexed per window: an item's source is a binary search over the
sources' counts, and the window a position within a pass of the source's own order
(order.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ddp_amp.data.order import GlobalOrder


class Mixture(Dataset):
    """`parts`: (dataset, weight) pairs; `seed` picks the partial passes' windows."""

    def __init__(self, parts: Sequence[tuple[Dataset, float]], seed: int) -> None:
        self.parts = [dataset for dataset, _ in parts]
        self.sizes = [len(dataset) for dataset in self.parts]  # type: ignore[arg-type]  # map-style datasets
        self.counts = [round(weight * size) for (_, weight), size in zip(parts, self.sizes)]
        self.passes = [max(1, math.ceil(count / size)) if size else 1 for count, size in zip(self.counts, self.sizes)]
        self.ends = np.cumsum(self.counts)
        self.orders = [GlobalOrder(size, seed * 1_000_003 + index) if size else None
                       for index, size in enumerate(self.sizes)]
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(index)
        source = int(np.searchsorted(self.ends, index, side="right"))
        within = index - (int(self.ends[source - 1]) if source else 0)
        size, order = self.sizes[source], self.orders[source]
        if self.counts[source] == size or order is None:  # used exactly once: the stream's order shuffles it
            return self.parts[source][within]
        turn = self.epoch * self.passes[source] + within // size
        return self.parts[source][int(order.take(turn, within % size, 1)[0])]
