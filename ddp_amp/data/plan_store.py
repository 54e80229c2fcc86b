"""Window plans: which documents (or which windows) a split's windows are, made once per split
and window shape, kept in the cache entry beside the split, or in memory where it cannot be.

A plan is a few uint64 arrays and a small record of facts (its counts, for the start line).
`planned(prefix, make)` (collective) returns it:
- where the entry holds it (`<prefix>.json` there, and every array file of the size it
  records), every rank memory-maps its arrays;
- else rank 0 makes it and writes it into the entry: each array to `<prefix>.<name>`, then
  `<prefix>.json` last (a reader takes the plan as written once that name exists), each file
  written atomically, so two jobs writing the same plan leave one whole copy;
- where the entry cannot be written (a shared cache built once and mounted read-only for the
  jobs that train on it, or a full disk), every rank makes the plan itself and keeps it in
  memory for this run: 8 bytes per entry of each array. A plan is a function of the split
  and the window shape alone (`make` reads nothing else and draws nothing), so every rank,
  at any world size, holds the same one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddp_amp.data.token_store import random_access_map
from ddp_amp.distributed import on_every_rank, on_rank_zero
from ddp_amp.durable import write_atomic
from ddp_amp.errors import UsageError

Made = tuple[dict[str, np.ndarray], dict[str, Any]]  # the arrays (uint64) and the facts


class PlanArrays:
    """A plan's named uint64 arrays: memory-mapped from `<prefix>.<name>` on first use, or held."""

    def __init__(self, prefix: Path | None, held: dict[str, np.ndarray] | None = None) -> None:
        self.prefix = prefix
        self._arrays: dict[str, np.ndarray] = dict(held or {})

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker maps the files itself; an array held in memory goes with it.
        return {**self.__dict__, "_arrays": {} if self.prefix is not None else self._arrays}

    def __getitem__(self, name: str) -> np.ndarray:
        found = self._arrays.get(name)
        if found is None:
            if self.prefix is None:
                raise KeyError(name)
            found = self._arrays[name] = random_access_map(_file(self.prefix, name), np.dtype(np.uint64))
        return found


@dataclass(frozen=True)
class Plan:
    arrays: PlanArrays
    facts: dict[str, Any]
    held_because: str  # why it is held in memory ("" where the entry holds it)


def _file(prefix: Path, name: str) -> Path:
    return prefix.with_name(f"{prefix.name}.{name}")


def _written(prefix: Path) -> dict[str, Any] | None:
    """The facts of the plan at `prefix`, where it is whole there."""
    try:
        record = json.loads(_file(prefix, "json").read_text())
        sizes = record["sizes"]
        if all(_file(prefix, name).stat().st_size == 8 * count for name, count in sizes.items()):
            return dict(record["facts"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _seen(prefix: Path) -> dict[str, Any]:
    facts = _written(prefix)
    if facts is None:
        raise UsageError("--data-cache", str(prefix.parent.parent), "a folder every rank sees (a shared file system)",
                         f"rank 0 wrote {_file(prefix, 'json').name} into {prefix.parent.name}, this rank does not "
                         "see it; pass --data-cache on a file system all nodes mount")
    return facts


def _unwritable(folder: Path) -> str:
    """Why nothing can be written into `folder` ("" where a file can be made there)."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
    except OSError as error:
        return f"{error.strerror or error}"
    os.close(handle)
    os.unlink(probe)
    return ""


def _write(prefix: Path, made: Made) -> None:
    arrays, facts = made
    for name, values in arrays.items():
        write_atomic(_file(prefix, name), np.ascontiguousarray(values, dtype=np.uint64).tobytes())
    record = {"sizes": {name: len(values) for name, values in arrays.items()}, "facts": facts}
    write_atomic(_file(prefix, "json"), json.dumps(record, indent=1))


def planned(prefix: Path, make: Callable[[], Made]) -> Plan:
    """The plan at `prefix` (`<cache entry>/<split>.<plan name>`), made by `make()` where the
    entry holds none (collective: call on every rank, in the same order)."""
    made: list[Made] = []

    def on_rank_zero_() -> str:
        if _written(prefix) is not None:
            return ""
        reason = _unwritable(prefix.parent)
        if reason:
            return f"the cache entry cannot be written: {reason}"
        made.append(make())
        try:
            _write(prefix, made[0])
        except OSError as error:
            return f"it could not be written into the cache entry: {error.strerror or error}"
        return ""

    held_because = on_rank_zero(on_rank_zero_)
    if not held_because:
        return Plan(PlanArrays(prefix), on_every_rank(lambda: _seen(prefix)), "")
    arrays, facts = on_every_rank(lambda: made[0] if made else make())
    return Plan(PlanArrays(None, {name: np.asarray(values, np.uint64) for name, values in arrays.items()}), facts,
                held_because)
