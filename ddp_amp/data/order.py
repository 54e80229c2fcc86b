"""A seeded shuffle of `size` items, computed per index: O(1) memory whatever the size.

`GlobalOrder(size, seed).take(epoch, start, count)` is the items at positions
start..start+count-1 of epoch `epoch`'s order. Each epoch's order is a permutation of
range(size), a different one per epoch and per seed, and the same on every rank and every
world size: nothing is built per epoch, so a dataset of 2e9 items costs no 16 GB
`randperm` on every rank (what torch's `DistributedSampler` builds each epoch).

How: a balanced Feistel network over the smallest even number of bits that holds `size` is
a bijection of [0, 2^bits); an index it maps past the end is mapped again ("cycle walking")
until it lands inside, which keeps the bijection on [0, size). The domain is less than
4 x size, so an index walks fewer than 4 times on average. Six rounds, each keyed from the
seed and the epoch through splitmix64, mix well enough for a training shuffle (this is a
shuffle, not a cipher). Everything is vectorised over numpy uint64 arrays, whose
multiplication wraps modulo 2^64 as the mixing needs.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """One step of splitmix64 on a Python int: a well-spread 64-bit key from any integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """The round function: splitmix64's finaliser of `values ^ key`, elementwise."""
    x = values ^ key
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class GlobalOrder:
    """Epoch-wise permutations of range(`size`), seeded by `seed`, computed per position."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError(f"an order needs at least one item, got size={size}")
        self.size, self.seed = size, seed
        bits = max(2, (size - 1).bit_length())
        self._half = (bits + 1) // 2  # a balanced network: two halves of equal width
        self._mask = np.uint64((1 << self._half) - 1)

    def _keys(self, epoch: int) -> list[np.uint64]:
        base = splitmix64(splitmix64(self.seed) ^ epoch)
        return [np.uint64(splitmix64(base + round_)) for round_ in range(_ROUNDS)]

    def _permute(self, values: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
        half = np.uint64(self._half)
        left, right = values >> half, values & self._mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & self._mask)
        return (left << half) | right

    def take(self, epoch: int, start: int, count: int) -> np.ndarray:
        """Items at positions [start, start + count) of epoch `epoch`'s order (int64)."""
        if start < 0 or count < 0 or start + count > self.size:
            raise IndexError(f"positions {start}..{start + count} outside an order of {self.size}")
        keys = self._keys(epoch)
        values = self._permute(np.arange(start, start + count, dtype=np.uint64), keys)
        size = np.uint64(self.size)
        outside = values >= size
        while outside.any():  # cycle walking: a value past the end is mapped again
            values[outside] = self._permute(values[outside], keys)
            outside = values >= size
        return values.astype(np.int64)
