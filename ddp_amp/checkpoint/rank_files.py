"""Each rank's own files of a checkpoint, written and hashed by the rank itself, and pinned by one leaf.

    <checkpoint>/rng/rank-NNNNN.pt      the rank's RNG states (rng.py)
    <checkpoint>/per_rank/rank-NNNNN.pt its values of the per-rank entries, where there are some (rank_values.py)
    <checkpoint>/sharded/__N_<n>.distcp its DCP shards, where the state is sharded (shard_writer.py)
    <checkpoint>/ranks/rank-NNNNN.json  its record: {"format": 2, "rank": N, "files": {name: {size, sha256}}}

A rank writes its files into the scratch directory rank 0 made, each hashed on its way out,
then its record, last, so a record exists only once the files it lists are whole. What rank 0
learns of it is one fixed-size report (rank_reports.py): the record's leaf, sha256 of the rank
and the record's sha256, or why the rank could not write. The manifest keeps the XOR of all
leaves and their count (manifest.py): a few hundred bytes at any world size that still pin
every rank's record, and through it every file. XOR, so the check splits over any number of
ranks: each folds the leaves of the records it checks, and rank 0 folds those (verify.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import CheckpointException

from ddp_amp.checkpoint.hashed_write import write_hashed
from ddp_amp.checkpoint.manifest import FORMAT_VERSION, SHARDED_DIR, FileRecord, IncompleteCheckpoint
from ddp_amp.checkpoint.rank_reports import DIGEST_BYTES, encode_report
from ddp_amp.checkpoint.rank_values import per_rank_file
from ddp_amp.checkpoint.rng import RNG_DIR, rng_file

RANKS_DIR = "ranks"
OWN_FOLDERS = (RNG_DIR, RANKS_DIR)  # made by rank 0 in the scratch directory before any rank writes
NO_LEAF = bytes(DIGEST_BYTES)  # what a rank that could not write reports beside its reason


def record_name(rank: int) -> str:
    """The checkpoint-relative name of rank `rank`'s record."""
    return f"{RANKS_DIR}/rank-{rank:05d}.json"


def leaf(rank: int, record_sha256: str) -> bytes:
    """Rank `rank`'s leaf: what the manifest's digest folds in for its record."""
    return hashlib.sha256(f"ddp_amp rank {rank} record {record_sha256}".encode()).digest()


def fold(leaves: Iterable[bytes]) -> bytes:
    """The XOR of `leaves` (32 bytes each); 32 zero bytes for none."""
    folded = 0
    for item in leaves:
        folded ^= int.from_bytes(item, "big")
    return folded.to_bytes(DIGEST_BYTES, "big")


def _encode_record(rank: int, files: Mapping[str, FileRecord]) -> bytes:
    return (json.dumps({"format": FORMAT_VERSION, "rank": rank, "files": dict(files)}, indent=1, sort_keys=True)
            + "\n").encode()


def write_own_files(scratch: Path, rank: int, rng_state: dict[str, Any],
                    shards: Callable[[], Mapping[str, FileRecord]] | None = None,
                    values: Mapping[str, Any] | None = None) -> bytes:
    """Write this rank's part of a checkpoint into `scratch` (its shards through `shards()`,
    which returns their records, then its RNG file, its per-rank `values` where given, then
    its record), each file hashed as it is written; return its report for rank 0
    (`encode_report`). A failure is reported, not raised: every rank must reach the exchange
    that follows."""
    try:
        written = dict(shards()) if shards is not None else {}
        written[rng_file(rank)] = write_hashed(scratch / rng_file(rank), rng_state)
        if values:
            written[per_rank_file(rank)] = write_hashed(scratch / per_rank_file(rank), dict(values))
        record = write_hashed(scratch / record_name(rank), _encode_record(rank, written))
        return encode_report(leaf(rank, record["sha256"]))
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's is a BaseException; rank 0 reports any
        return encode_report(NO_LEAF, f"rank {rank}: {type(error).__name__}: {_first_line(error)}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def _owned(rank: int) -> re.Pattern[str]:
    """The names rank `rank`'s record may list: its RNG file, its per-rank values and its
    shards, nothing else."""
    return re.compile(rf"^({re.escape(rng_file(rank))}|{re.escape(per_rank_file(rank))}"
                      rf"|{SHARDED_DIR}/__{rank}_\d+\.distcp)$")


@dataclass(frozen=True)
class RankRecord:
    """One rank's record, read back: the files it lists, its leaf, and its own size and sha256."""

    files: dict[str, FileRecord]
    leaf: bytes
    record: FileRecord


def read_record(directory: Path, rank: int) -> RankRecord:
    """Rank `rank`'s record in checkpoint `directory`, hashed as it is read; IncompleteCheckpoint
    where it is missing, or not a record of that rank's files."""
    path = directory / record_name(rank)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise IncompleteCheckpoint(f"{path}: rank {rank}'s record is missing") from None
    except OSError as error:
        raise IncompleteCheckpoint(f"{path}: unreadable ({error.strerror or error})") from None
    try:
        record = json.loads(raw)
    except ValueError as error:
        raise IncompleteCheckpoint(f"{path}: not a rank's record ({error})") from None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("rank") != rank or not isinstance(files, dict):
        raise IncompleteCheckpoint(f"{path}: not rank {rank}'s record")
    owned = _owned(rank)
    for name, entry in files.items():
        if not owned.match(name) or not isinstance(entry, dict):
            raise IncompleteCheckpoint(f"{path}: lists {name!r}, which is not a file of rank {rank}'s")
    digest = hashlib.sha256(raw).hexdigest()
    return RankRecord(files, leaf(rank, digest), {"size": len(raw), "sha256": digest})
