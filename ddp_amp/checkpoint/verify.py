"""Which files of a checkpoint each rank checks on resume, and the agreement that makes the check whole.

Every rank reads what it restores itself, so every rank checks what it reads, and no more:
- the replicated files (meta.json, state.pt, each module's and per-rank entry's file, the
  shards' map `sharded/.metadata`, an older layout's `rng.pt`), which every rank reads;
- its own RNG file `rng/rank-NNNNN.pt`;
- its own shards `sharded/__<r>_<n>.distcp`. On another number of ranks, the saved rank
  r's shards are checked by rank `r % world_size`, so every shard file is hashed by exactly
  one rank and none by two.
Rank 0 alone checks that every listed file exists with its size (a `stat` each, no reads)
and that the shards' map names only files the manifest lists, within their sizes; then every
rank hashes its own and the outcome is gathered: a file any rank finds altered makes every
rank skip that checkpoint for an older one (`--resume auto`) or refuse it (a named PATH),
alike. The hashes were taken while the files were written (commit.py, sharded.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ddp_amp.checkpoint.manifest import IncompleteCheckpoint, check_listed_file, read_manifest, verify_checkpoint
from ddp_amp.distributed import all_gather_objects, on_rank_zero

_SHARD = re.compile(r"^sharded/__(\d+)_\d+\.distcp$")
_RNG = re.compile(r"^rng/rank-(\d+)\.pt$")


def reads_file(name: str, rank: int, world_size: int) -> bool:
    """Whether `rank` of `world_size` checks the manifest's file `name` (see the module's docstring)."""
    shard = _SHARD.match(name)
    if shard:
        return int(shard.group(1)) % world_size == rank
    own_rng = _RNG.match(name)
    if own_rng:
        return int(own_rng.group(1)) == rank
    return name != "manifest.json"


@dataclass(frozen=True)
class OwnCheck:
    """One rank's hash check of one checkpoint: why it failed (None: it passed), what it read."""

    failure: str | None
    files: int
    bytes_hashed: int
    seconds: float


def check_own_files(directory: Path, rank: int, world_size: int) -> OwnCheck:
    """Hash the files of `directory` that `rank` reads against its manifest (no collectives)."""
    started = time.perf_counter()
    count = hashed = 0
    try:
        listed: dict[str, Any] = read_manifest(directory)["files"]
        for name, expected in sorted(listed.items()):
            if not reads_file(name, rank, world_size):
                continue
            size = check_listed_file(directory / name, expected)
            count, hashed = count + 1, hashed + size
    except (IncompleteCheckpoint, OSError) as reason:
        return OwnCheck(f"rank {rank}: {reason}", count, hashed, time.perf_counter() - started)
    return OwnCheck(None, count, hashed, time.perf_counter() - started)


def sizes_failure(directory: Path) -> str | None:
    """Rank 0's cheap check of `directory`: every listed file there with its size, the shards'
    map within them; why not, or None."""
    try:
        verify_checkpoint(directory, check_hashes=False)
    except IncompleteCheckpoint as reason:
        return str(reason)
    return None


def agree_on(candidates: list[Path], rank: int, world_size: int, warn: Callable[[str], None],
             verified: set[Path]) -> tuple[Path | None, str]:
    """The first of `candidates` (newest first) complete on every rank, and the last reason
    one was skipped (collective; every rank passes the same list). A skipped one is told to
    `warn` on rank 0. Paths in `verified` (checked earlier by this process group) are
    taken as they are; the one chosen is added."""
    reason = ""
    for index, path in enumerate(candidates):
        if path in verified:
            return path, reason
        sized = on_rank_zero(partial(sizes_failure, path))
        failures = [sized] if sized else [check.failure for check in
                                           all_gather_objects(check_own_files(path, rank, world_size))
                                           if check.failure]
        if not failures:
            verified.add(path)
            return path, reason
        reason = failures[0] or ""
        if rank == 0:
            more = "; trying the next older one" if index + 1 < len(candidates) else ""
            warn(f"skipping incomplete checkpoint {path}: {reason}{more}")
    return None, reason
