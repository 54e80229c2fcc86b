"""Tokenizing one unit of a source into a cache entry's staging folder, and joining the units.

Each rank tokenizes its share of the units (token_cache.py deals them out) and writes, per
unit and split, the raw token ids, each document's length and row, and the loss mask, then a
small `unit-NNNNNN.json` that says the unit is done (renamed into place last, so a unit
half-written by a killed rank is never taken for done). Rank 0 then joins the units, in
order, into the entry's files (token_store.py): the same files whoever tokenized what, so an
entry built by 8 ranks equals one built by 1.

A document is held out (the `eval` split) where a hash of its file and row falls below
`test_size`: about that fraction of documents, the same ones on every build.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from functools import partial
from itertools import chain
from pathlib import Path
from typing import IO, Any

import numpy as np

from ddp_amp.data.encoding import Encoder, TextFormat, row_kind
from ddp_amp.data.order import splitmix64
from ddp_amp.data.readers import Unit, read_rows, where
from ddp_amp.data.token_store import FORMAT, LOCATOR_BITS, META
from ddp_amp.durable import fsync_dir
from ddp_amp.errors import UsageError

BATCH_ROWS = 512  # rows encoded together: the tokenizer's batch runs on its own threads
SPLITS = ("train", "eval")


def held_out(file_index: int, locator: int, test_size: float) -> bool:
    """Whether the row at `locator` of the source's file `file_index` goes to the eval split."""
    if test_size <= 0:
        return False
    return splitmix64(splitmix64(file_index + 1) ^ locator) < test_size * 2.0**64


def _unit_path(staging: Path, index: int, suffix: str) -> Path:
    return staging / f"unit-{index:06d}.{suffix}"


class _SplitWriter:
    """One unit's files for one split, opened when its first document arrives."""

    def __init__(self, staging: Path, index: int, split: str, dtype: np.dtype[Any]) -> None:
        self.staging, self.index, self.split, self.dtype = staging, index, split, dtype
        self.lengths: list[int] = []
        self.rows: list[int] = []
        self.max_id = -1
        self._tokens: IO[bytes] | None = None
        self._mask: IO[bytes] | None = None

    def add(self, documents: list[tuple[list[int], list[int] | None, int]]) -> None:
        """Append (ids, mask, locator) documents: one write of each file per batch."""
        if not documents:
            return
        if self._tokens is None:
            self._tokens = _unit_path(self.staging, self.index, f"{self.split}.tokens").open("wb")
            if documents[0][1] is not None:
                self._mask = _unit_path(self.staging, self.index, f"{self.split}.mask").open("wb")
        ids = np.fromiter(chain.from_iterable(doc for doc, _, _ in documents), dtype=np.int64)
        self.max_id = max(self.max_id, int(ids.max()))
        self._tokens.write(ids.astype(self.dtype).tobytes())
        if self._mask is not None:
            self._mask.write(np.fromiter(chain.from_iterable(mask or () for _, mask, _ in documents),
                                         dtype=np.uint8).tobytes())
        self.lengths += [len(doc) for doc, _, _ in documents]
        self.rows += [locator for _, _, locator in documents]

    def close(self) -> dict[str, int]:
        for stream in (self._tokens, self._mask):
            if stream is not None:
                stream.flush()
                os.fsync(stream.fileno())
                stream.close()
        np.asarray(self.lengths, dtype=np.uint64).tofile(_unit_path(self.staging, self.index, f"{self.split}.lengths"))
        np.asarray(self.rows, dtype=np.uint64).tofile(_unit_path(self.staging, self.index, f"{self.split}.rows"))
        return {"documents": len(self.lengths), "tokens": int(sum(self.lengths)), "max_id": self.max_id}


def tokenize_unit(unit: Unit, index: int, file_index: int, encoder: Encoder, fmt: TextFormat, test_size: float,
                  dtype: np.dtype[Any], staging: Path, counted: Callable[[int, int], None]) -> None:
    """Tokenize `unit` (the source's unit `index`, of its file `file_index`) into `staging`;
    `counted(documents, tokens)` is told after each batch (the progress bar)."""
    writers = {split: _SplitWriter(staging, index, split, dtype) for split in SPLITS}
    kind: str | None = None
    empty = 0
    batch: list[tuple[int, dict[str, Any]]] = []

    def flush() -> None:
        nonlocal empty
        if kind is None or not batch:
            return
        encoded = encoder.encode(kind, [row for _, row in batch], lambda i: where(unit, batch[i][0]))
        placed: dict[str, list[tuple[list[int], list[int] | None, int]]] = {split: [] for split in SPLITS}
        for (locator, _), (ids, mask) in zip(batch, encoded):
            if not ids:
                empty += 1
                continue
            placed["eval" if held_out(file_index, locator, test_size) else "train"].append((ids, mask, locator))
        for split, documents in placed.items():
            writers[split].add(documents)
        counted(len(batch), sum(len(ids) for ids, _ in encoded))
        batch.clear()

    for locator, row in read_rows(unit, fmt.sample_by):
        located = partial(where, unit, locator)
        if kind is None:
            kind = row_kind(row, fmt, located, unit.file.flag)
            encoder.check(kind, unit.file.path)
        elif row_kind(row, fmt, located, unit.file.flag) != kind:
            raise UsageError(unit.file.flag, located(), f"rows of one kind in a source (the first was {kind})",
                             "give text, conversations and completions as separate --data sources")
        batch.append((locator, row))
        if len(batch) >= BATCH_ROWS:
            flush()
    flush()
    marker = {"kind": kind, "empty": empty, "splits": {split: writer.close() for split, writer in writers.items()}}
    done = _unit_path(staging, index, "json")
    pending = done.with_suffix(".json.partial")
    pending.write_text(json.dumps(marker))
    os.replace(pending, done)  # the unit is done only once this name exists


def unit_done(staging: Path, index: int) -> bool:
    return _unit_path(staging, index, "json").exists()


def _append(out: IO[bytes], path: Path) -> None:
    if path.exists():
        with path.open("rb") as source:
            shutil.copyfileobj(source, out, 16 << 20)


def join_units(staging: Path, units: list[Unit], made_from: dict[str, Any], dtype: np.dtype[Any], spec: str,
               test_size: float, flag: str = "--data") -> dict[str, Any]:
    """Rank 0: join every unit's files into the entry's, write meta.json; returns it (`spec`
    and `flag` name the source in an error)."""
    markers = [json.loads(_unit_path(staging, i, "json").read_text()) for i in range(len(units))]
    kinds = sorted({marker["kind"] for marker in markers if marker["kind"]})
    if len(kinds) > 1:
        raise UsageError(flag, spec, f"rows of one kind in a source (found {' and '.join(kinds)})",
                         "give text, conversations and completions as separate --data sources")
    kind = kinds[0] if kinds else "text"
    masked = kind != "text"
    splits: dict[str, dict[str, int]] = {}
    for split in SPLITS if test_size > 0 else SPLITS[:1]:
        counts = {"documents": 0, "tokens": 0, "max_id": -1}
        with (staging / f"{split}.tokens").open("wb") as tokens, (staging / f"{split}.offsets").open("wb") as offsets, \
                (staging / f"{split}.rows").open("wb") as rows, (staging / f"{split}.mask").open("wb") as mask:
            np.zeros(1, dtype=np.uint64).tofile(offsets)
            for index in range(len(units)):
                part = markers[index]["splits"][split]
                lengths = np.fromfile(_unit_path(staging, index, f"{split}.lengths"), dtype=np.uint64)
                (np.cumsum(lengths, dtype=np.uint64) + np.uint64(counts["tokens"])).tofile(offsets)
                located = np.fromfile(_unit_path(staging, index, f"{split}.rows"), dtype=np.uint64)
                (located | np.uint64(index << LOCATOR_BITS)).tofile(rows)
                _append(tokens, _unit_path(staging, index, f"{split}.tokens"))
                if masked:
                    _append(mask, _unit_path(staging, index, f"{split}.mask"))
                counts["documents"] += part["documents"]
                counts["tokens"] += part["tokens"]
                counts["max_id"] = max(counts["max_id"], part["max_id"])
            for stream in (tokens, offsets, rows, mask):
                stream.flush()
                os.fsync(stream.fileno())
        if not masked:
            (staging / f"{split}.mask").unlink()
        splits[split] = counts
    if splits["train"]["documents"] == 0:
        raise UsageError(flag, spec, "at least one non-empty document" + (" for training" if test_size else ""),
                         f"its {sum(m['empty'] for m in markers)} row(s) tokenized to nothing, or every one was "
                         "held out (lower --task-opt test_size)")
    for path in staging.glob("unit-*"):
        path.unlink()
    meta = {"format": FORMAT, "made_from": made_from, "dtype": dtype.name, "kind": kind, "masked": masked,
            "units": [unit.to_list() for unit in units], "splits": splits,
            "empty_rows": sum(marker["empty"] for marker in markers)}
    (staging / META).write_text(json.dumps(meta, indent=1))
    fsync_dir(staging)
    return meta
