"""A tokenized source on disk, and reading it without loading it.

One cache entry is a folder, `<cache>/<key>/`, that appears whole or not at all (it is
renamed into place once complete: token_cache.py). For each split (`train`, and `eval` when
part of the source is held out) it holds:
- `<split>.tokens`: every document's token ids, end to end, as uint16 (a vocabulary of at
  most 65,536 ids) or uint32;
- `<split>.offsets`: uint64, documents + 1 entries: document d is tokens[offsets[d]:offsets[d+1]];
- `<split>.rows`: uint64 per document, where its row came from (unit << 40 | locator), read
  only to name the row of a bad token;
- `<split>.mask`: uint8 per token, 1 where the loss covers it (conversations and completions
  only; text documents have no mask);
and `meta.json`, written last: what made it, the dtype, the units read, and each split's
counts and largest token id. Nothing is loaded: tokens and masks are read with `pread` per
window, and the document index is memory-mapped with random-access advice (the kernel's
readahead would otherwise read megabytes around each window: 2.6 ms a window, against 8 us,
measured on a 16 GB file). Files are opened on first use and reopened after pickling
(DataLoader workers), so a rank's memory does not grow with the data.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

META = "meta.json"
FORMAT = 1
LOCATOR_BITS = 40  # rows index: unit << 40 | locator (a byte offset up to 1 TiB, or a row number)
FILES = ("tokens", "offsets", "rows", "mask")


def token_dtype(vocabulary: int) -> np.dtype[Any]:
    """The narrowest dtype that holds ids below `vocabulary`."""
    return np.dtype(np.uint16) if vocabulary <= 1 << 16 else np.dtype(np.uint32)


def expected_sizes(meta: dict[str, Any]) -> dict[str, int]:
    """Each file's size in bytes as `meta` describes it."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    sizes = {}
    for split, counts in meta["splits"].items():
        sizes[f"{split}.tokens"] = counts["tokens"] * itemsize
        sizes[f"{split}.offsets"] = (counts["documents"] + 1) * 8
        sizes[f"{split}.rows"] = counts["documents"] * 8
        if meta["masked"]:
            sizes[f"{split}.mask"] = counts["tokens"]
    return sizes


def complete(folder: Path) -> bool:
    """Whether `folder` is a finished entry: meta.json readable and every file of its size."""
    try:
        meta = json.loads((folder / META).read_text())
        return meta.get("format") == FORMAT and all(
            (folder / name).stat().st_size == size for name, size in expected_sizes(meta).items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def random_access_map(path: Path, dtype: np.dtype[Any]) -> np.ndarray:
    """`path` memory-mapped read-only, told the kernel to read no more than it is asked."""
    if not path.stat().st_size:
        return np.zeros(0, dtype)
    mapped = np.memmap(path, dtype=dtype, mode="r")
    mapped._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]  # numpy keeps the mmap object there
    return mapped


class TokenSplit:
    """One split of an entry: its tokens, document offsets and mask, memory-mapped on use."""

    def __init__(self, folder: Path, split: str) -> None:
        self.folder, self.split = folder, split
        self.meta = json.loads((folder / META).read_text())
        counts = self.meta["splits"][split]
        self.documents, self.tokens, self.max_id = counts["documents"], counts["tokens"], counts["max_id"]
        self.masked: bool = self.meta["masked"]
        self.dtype = np.dtype(self.meta["dtype"])
        self._maps: dict[str, np.ndarray] = {}
        self._files: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}, "_files": {}}  # a worker opens the files itself

    def __del__(self) -> None:
        for descriptor in self.__dict__.get("_files", {}).values():
            os.close(descriptor)

    def _map(self, name: str) -> np.ndarray:
        found = self._maps.get(name)
        if found is None:
            found = random_access_map(self.folder / f"{self.split}.{name}", np.dtype(np.uint64))
            self._maps[name] = found
        return found

    def _read(self, name: str, dtype: np.dtype[Any], start: int, stop: int) -> np.ndarray:
        descriptor = self._files.get(name)
        if descriptor is None:
            descriptor = self._files[name] = os.open(self.folder / f"{self.split}.{name}", os.O_RDONLY)
        data = os.pread(descriptor, (stop - start) * dtype.itemsize, start * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype)

    @property
    def offsets(self) -> np.ndarray:
        return self._map("offsets")

    def token_slice(self, start: int, stop: int) -> np.ndarray:
        return self._read("tokens", self.dtype, start, stop)

    def mask_slice(self, start: int, stop: int) -> np.ndarray | None:
        return self._read("mask", np.dtype(np.uint8), start, stop) if self.masked else None

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """The positions in [start, stop) where a document begins (binary search: O(log documents))."""
        offsets = self.offsets
        low, high = np.searchsorted(offsets, [start, stop], side="left")
        return np.asarray(offsets[low:high], dtype=np.int64)

    def lengths(self) -> np.ndarray:
        """Every document's length (reads the whole offsets file: for packing, once)."""
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def row_of(self, document: int) -> tuple[int, int]:
        """(unit index, locator) of the row document `document` came from."""
        packed = int(self._map("rows")[document])
        return packed >> LOCATOR_BITS, packed & ((1 << LOCATOR_BITS) - 1)

    def targets_in(self, lows: np.ndarray, highs: np.ndarray, skip_starts: bool, chunk: int = 1 << 24) -> np.ndarray:
        """How many targets each span [lows[i], highs[i]) holds: tokens the mask covers (every
        token where the split has no mask), not counting a document's first token where
        `skip_starts` (a window that keeps boundaries predicts none). One pass over the mask, a
        chunk at a time: O(tokens) read, O(spans) memory."""
        points = np.concatenate([np.asarray(lows, np.int64), np.asarray(highs, np.int64)])
        order = np.argsort(points, kind="stable")
        ranked = points[order]
        before = np.zeros(len(points), dtype=np.int64)  # targets before each point
        total, done = 0, 0
        for start in range(0, self.tokens, chunk):
            stop = min(start + chunk, self.tokens)
            mask = self.mask_slice(start, stop)
            block = np.ones(stop - start, np.uint8) if mask is None else mask.copy()  # pread's buffer is read-only
            if skip_starts:
                block[self.document_starts(start, stop) - start] = 0
            counts = np.cumsum(block, dtype=np.int32)  # a chunk's count fits
            upto = int(np.searchsorted(ranked, stop, side="right"))
            inside = ranked[done:upto] - start  # points in (start, stop]; 0 at a chunk's start
            before[order[done:upto]] = total + np.where(inside > 0, counts[np.maximum(inside, 1) - 1], 0)
            total += int(counts[-1])
            done = upto
        before[order[done:]] = total
        return before[len(lows):] - before[:len(lows)]

    def first_token_at_least(self, limit: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
        """(position, id) of the first token id >= `limit`, or None: a chunked scan."""
        for start in range(0, self.tokens, chunk):
            block = self.token_slice(start, min(start + chunk, self.tokens))
            hits = np.flatnonzero(block >= limit)
            if hits.size:
                return start + int(hits[0]), int(block[hits[0]])
        return None
