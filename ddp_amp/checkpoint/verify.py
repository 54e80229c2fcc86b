"""Checking a checkpoint before it is read: all of it in one process, or split over the ranks on resume.

What is checked, each file's size and sha256 against what was hashed as it was written:
- rank 0's files, listed in the manifest (meta.json, state.pt, each module's file, the
  shards' map `sharded/.metadata`), which every rank reads;
- each rank's record `ranks/rank-NNNNN.json`, the files it lists (that rank's RNG file,
  per-rank values and shards), and the manifest's digest over the records (manifest.py,
  rank_files.py);
- that the shards' map names only listed files, and reads within them.

`verify_checkpoint` checks all of it in the calling process (export, discovery before a
run). On resume every rank checks what it reads, and no rank, rank 0 included, does work
that grows with the number of ranks:
- every rank hashes rank 0's files;
- rank r of W checks the records of the saved ranks r, r + W, r + 2W ... (on as many ranks
  as saved it, its own), their files and the map's entries for their shards, and folds
  their leaves, so every record and shard file is checked by exactly one rank;
- one exchange of fixed-size reports (rank_reports.py: all-reduces, no fan-in to rank 0)
  brings rank 0 the XOR of every rank's fold, or the first rank's failure; rank 0 compares
  that XOR with the manifest's digest and tells every rank the outcome. A file any rank
  finds altered makes every rank skip that checkpoint for an older one (`--resume auto`)
  or refuse it (a named PATH), alike.
A checkpoint of format 1 (every rank's files listed in the manifest) is checked as before:
rank 0 checks that every listed file is there with its size, and each rank hashes the
replicated files, its own RNG file and its own shards.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ddp_amp.checkpoint.manifest import (LISTING_FORMAT, FileRecord, IncompleteCheckpoint, check_listed_file,
                                         check_shard_map, ranks_record, read_manifest)
from ddp_amp.checkpoint.rank_files import NO_LEAF, fold, read_record, record_name
from ddp_amp.checkpoint.rank_reports import Reports, encode_report, exchange_reports
from ddp_amp.distributed import on_rank_zero

_SHARD = re.compile(r"^sharded/__(\d+)_\d+\.distcp$")
_RNG = re.compile(r"^rng/rank-(\d+)\.pt$")


def reads_file(name: str, rank: int, world_size: int) -> bool:
    """Whether `rank` of `world_size` hashes format-1 manifest's file `name` (see the module's docstring)."""
    shard = _SHARD.match(name)
    if shard:
        return int(shard.group(1)) % world_size == rank
    own_rng = _RNG.match(name)
    if own_rng:
        return int(own_rng.group(1)) == rank
    return name != "manifest.json"


def _owner(name: str) -> int:
    """The saved rank whose shards file `name` holds; 0 for a name of no rank's (rank 0 answers for it)."""
    shard = _SHARD.match(name)
    return int(shard.group(1)) if shard else 0


@dataclass
class _Part:
    """What one rank's share of the check saw: the files, the bytes hashed, the leaves' fold."""

    listed: dict[str, FileRecord] = field(default_factory=dict)
    bytes_hashed: int = 0
    fold: bytes = NO_LEAF

    def check(self, directory: Path, files: Mapping[str, FileRecord], check_hashes: bool) -> None:
        for name, expected in sorted(files.items()):
            self.bytes_hashed += check_listed_file(directory / name, expected, check_hashes)
            self.listed[name] = expected


def _check_part(directory: Path, manifest: dict[str, Any], rank: int, world_size: int,
                check_hashes: bool = True) -> _Part:
    """Rank `rank` of `world_size`'s share of checking format-2 checkpoint `directory` (the
    module's docstring); IncompleteCheckpoint for the first thing wrong."""
    part = _Part()
    part.check(directory, manifest["files"], check_hashes)
    ranks = ranks_record(manifest)
    leaves = []
    for saved in range(rank, ranks.count if ranks is not None else 0, world_size):
        record = read_record(directory, saved)
        part.listed[record_name(saved)] = record.record
        part.bytes_hashed += int(record.record["size"])
        part.check(directory, record.files, check_hashes)
        leaves.append(record.leaf)
    part.fold = fold(leaves)
    check_shard_map(directory, part.listed, lambda name: _owner(name) % world_size == rank)
    return part


def _digest_failure(directory: Path, manifest: dict[str, Any], folded: bytes) -> str | None:
    """Why the ranks' folded leaves do not match `manifest`'s digest, or None where they do."""
    ranks = ranks_record(manifest)
    expected = bytes.fromhex(ranks.digest) if ranks is not None else NO_LEAF
    if folded == expected:
        return None
    return (f"{directory}: the ranks' records do not match the manifest's digest over "
            f"{ranks.count if ranks is not None else 0} rank(s) (a record replaced or from another save)")


def verify_checkpoint(directory: Path, check_hashes: bool = True) -> dict[str, Any]:
    """Check every file of `directory`: its size (and sha256), the ranks' records against the
    manifest's digest, the shards' map within the files (in this process alone). Return the
    manifest with every file of the checkpoint in `files`, each rank's too; raise
    IncompleteCheckpoint for the first thing wrong."""
    manifest = read_manifest(directory)
    if manifest["format"] == LISTING_FORMAT:
        _Part().check(directory, manifest["files"], check_hashes)
        check_shard_map(directory, manifest["files"], lambda _: True)
        return manifest
    part = _check_part(directory, manifest, 0, 1, check_hashes)
    failure = _digest_failure(directory, manifest, part.fold) if check_hashes else None
    if failure is not None:
        raise IncompleteCheckpoint(failure)
    return {**manifest, "files": part.listed}


@dataclass(frozen=True)
class OwnCheck:
    """One rank's share of checking one checkpoint: why it failed (None: it passed), what it
    read, and the fold of the leaves of the records it checked."""

    failure: str | None
    files: int
    bytes_hashed: int
    seconds: float
    fold: bytes = NO_LEAF
    manifest: dict[str, Any] | None = None


def _legacy_part(directory: Path, manifest: dict[str, Any], rank: int, world_size: int) -> _Part:
    """A format-1 checkpoint's share for `rank`: rank 0 checks that every file is there with
    its size and within the shards' map, then each rank hashes what it reads."""
    listed = manifest["files"]
    if rank == 0:
        _Part().check(directory, listed, check_hashes=False)
        check_shard_map(directory, listed, lambda _: True)
    part = _Part()
    part.check(directory, {name: entry for name, entry in listed.items() if reads_file(name, rank, world_size)}, True)
    return part


def check_own_files(directory: Path, rank: int, world_size: int) -> OwnCheck:
    """Rank `rank` of `world_size`'s share of checking `directory` (the module's docstring; no collectives)."""
    started = time.perf_counter()
    manifest: dict[str, Any] | None = None
    try:
        manifest = read_manifest(directory)
        if manifest["format"] == LISTING_FORMAT:
            part = _legacy_part(directory, manifest, rank, world_size)
        else:
            part = _check_part(directory, manifest, rank, world_size)
    except (IncompleteCheckpoint, OSError) as reason:
        return OwnCheck(f"rank {rank}: {reason}", 0, 0, time.perf_counter() - started, manifest=manifest)
    return OwnCheck(None, len(part.listed), part.bytes_hashed, time.perf_counter() - started, part.fold, manifest)


def verdict(directory: Path, own: OwnCheck, reports: Reports | None) -> str | None:
    """Rank 0, once every rank's share is exchanged: why `directory` is not complete (the lowest
    rank's failure, or the folds against the manifest's digest), or None where it is."""
    if reports is None:
        raise RuntimeError("only rank 0 decides a checkpoint's check: it alone holds the exchanged reports")
    failure = reports.first_failure()
    if failure is not None or own.manifest is None or own.manifest["format"] == LISTING_FORMAT:
        return failure
    return _digest_failure(directory, own.manifest, reports.digest())


def agree_on(candidates: list[Path], rank: int, world_size: int, warn: Callable[[str], None],
             verified: set[Path], device: torch.device) -> tuple[Path | None, str]:
    """The first of `candidates` (newest first) complete on every rank, and the last reason
    one was skipped (collective; every rank passes the same list; the reports' tensors live
    on `device`). A skipped one is told to `warn` on rank 0. Paths in `verified` (checked
    earlier by this process group) are taken as they are; the one chosen is added."""
    reason = ""
    for index, path in enumerate(candidates):
        if path in verified:
            return path, reason
        own = check_own_files(path, rank, world_size)
        reports = exchange_reports(encode_report(own.fold, own.failure or ""), device)
        failure = on_rank_zero(partial(verdict, path, own, reports))
        if failure is None:
            verified.add(path)
            return path, reason
        reason = failure
        if rank == 0:
            more = "; trying the next older one" if index + 1 < len(candidates) else ""
            warn(f"skipping incomplete checkpoint {path}: {reason}{more}")
    return None, reason
