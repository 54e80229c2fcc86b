"""Several sources' windows as one dataset, each used WEIGHT times per epoch.

A source of n windows with weight w contributes c = round(w n) items to an epoch. Where c is
not n, they are the next c windows of the source's own seeded order (order.py), which runs on
from epoch to epoch (the stream calls `set_epoch`) and reshuffles at each pass: a source
weighted 0.5 shows half its windows in one epoch and the other half in the next; one weighted
2.5 shows each window 2 or 3 times an epoch. The stream's order then shuffles the whole
mixture. Nothing is indexed per window: an item's source is a binary search over the
sources' counts.
"""

from __future__ import annotations

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
        drawn = self.epoch * self.counts[source] + within  # how far through the source's passes
        return self.parts[source][int(order.take(drawn // size, drawn % size, 1)[0])]
