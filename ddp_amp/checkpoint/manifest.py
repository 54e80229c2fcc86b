"""The manifest: what makes a checkpoint directory complete, and how that is checked.

`manifest.json` is the last file written into a checkpoint's temporary directory, by rank 0,
once every rank reported its own files whole. It holds only what does not grow with the
number of ranks (format 2):

    {"format": 2, "step": N,
     "files": {name: {"size", "sha256"}},   rank 0's files, which every rank reads (state.pt,
                                            model.pt, meta.json, the shards' map ...)
     "ranks": {"count": R, "digest": hex}}  the R ranks' own records (rank_files.py): the XOR
                                            of one leaf per rank, each the rank and its record's sha256

Each rank's record lists the files that rank wrote (its RNG file, its per-rank values, its
shards) with their sizes and sha256, so every file of a checkpoint is pinned by the manifest through one chain
of hashes, and a reader can tell a complete checkpoint from a torn one (killed mid-write,
truncated by a full disk, bit rot) before unpickling anything. Format 1, written before,
listed every file of every rank in `files` and has no `ranks`; it is still read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.checkpoint.sharded_reader import SafeShardReader
from ddp_amp.errors import UsageError

MANIFEST_NAME = "manifest.json"
SHARDED_DIR = "sharded"  # a sharded checkpoint's DCP folder, and in it DCP's map of the shards
MAP_FILE = ".metadata"
FORMAT_VERSION = 2
LISTING_FORMAT = 1  # the format that lists every rank's files in `files`
READABLE_FORMATS = (LISTING_FORMAT, FORMAT_VERSION)
RANKS_KEY = "ranks"
_CHUNK = 1 << 20
FileRecord = dict[str, Any]  # {"size": bytes, "sha256": hex digest}


class IncompleteCheckpoint(Exception):
    """A checkpoint directory that fails its manifest check (missing, torn or altered)."""


def file_digest(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks so large checkpoints need no extra memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_of(path: Path) -> FileRecord:
    """A file written by another writer (torch.distributed.checkpoint's shards): fsynced here,
    then its size and sha256 for the manifest."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return {"size": path.stat().st_size, "sha256": file_digest(path)}


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class RanksRecord:
    """The manifest's record of the ranks' own files: how many ranks wrote a record, and the
    XOR of their leaves (rank_files.py), as hex."""

    count: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "digest": self.digest}


def ranks_record(manifest: Mapping[str, Any]) -> RanksRecord | None:
    """A format-2 manifest's `ranks` (checked by `read_manifest`); None where there is none."""
    raw = manifest.get(RANKS_KEY)
    return RanksRecord(int(raw["count"]), str(raw["digest"])) if isinstance(raw, dict) else None


def _check_ranks(directory: Path, raw: Any) -> None:
    """A `ranks` entry that is one: a count and a 64-digit hex digest."""
    if raw is None:
        return
    count, digest = (raw.get("count"), raw.get("digest")) if isinstance(raw, dict) else (None, None)
    if (not isinstance(count, int) or isinstance(count, bool) or count < 0 or not isinstance(digest, str)
            or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
        raise IncompleteCheckpoint(f"{directory}: {MANIFEST_NAME} has a malformed {RANKS_KEY!r} entry ({raw!r:.100})")


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse `directory/manifest.json`; raises IncompleteCheckpoint if absent or unreadable."""
    path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise IncompleteCheckpoint(f"{directory}: no {MANIFEST_NAME} (the write did not finish)") from None
    except (OSError, ValueError) as error:
        raise IncompleteCheckpoint(f"{directory}: unreadable {MANIFEST_NAME} ({error})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise IncompleteCheckpoint(f"{directory}: {MANIFEST_NAME} has no file list")
    if manifest.get("format") not in READABLE_FORMATS:
        raise IncompleteCheckpoint(f"{directory}: manifest format {manifest.get('format')!r}, "
                                   f"this ddp_amp reads formats {' and '.join(map(str, READABLE_FORMATS))}")
    _check_ranks(directory, manifest.get(RANKS_KEY))
    return manifest


def check_listed_file(path: Path, expected: dict[str, Any], check_hash: bool = True) -> int:
    """Check one file against its manifest entry (size, and sha256); return its size or raise
    IncompleteCheckpoint."""
    if not path.is_file():
        raise IncompleteCheckpoint(f"{path}: listed in the manifest but missing")
    size = path.stat().st_size
    if size != expected.get("size"):
        raise IncompleteCheckpoint(f"{path}: {size} bytes, manifest says {expected.get('size')}")
    if check_hash and file_digest(path) != expected.get("sha256"):
        raise IncompleteCheckpoint(f"{path}: sha256 differs from the manifest (corrupted)")
    return size


def check_shard_map(directory: Path, listed: Mapping[str, FileRecord], owns: Callable[[str], bool]) -> None:
    """A sharded checkpoint's map names only files that are listed, and reads within them:
    a shard file gone or cut short, with a manifest made to match, is caught here rather than
    in DCP's read on every rank. `listed`: the files checked (the manifest's, and the records'
    of the ranks checked); `owns(name)`: whether this check answers for the map's entries in
    file `name` (each rank for its own ranks' shards on resume, see verify.py)."""
    folder = directory / SHARDED_DIR
    if f"{SHARDED_DIR}/{MAP_FILE}" not in listed:
        return
    try:
        metadata = SafeShardReader(folder).read_metadata()
    except UsageError:  # a map that is not one: its loader refuses it, unexecuted, in one line
        return
    except (OSError, EOFError, ValueError) as error:
        raise IncompleteCheckpoint(f"{folder / MAP_FILE}: unreadable ({error})") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = f"{SHARDED_DIR}/{info.relative_path}"
        if owns(name):
            ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        if name not in listed:
            raise IncompleteCheckpoint(f"{directory / name}: named by the shards' map but not in the manifest")
        if end > int(listed[name].get("size", 0)):
            raise IncompleteCheckpoint(f"{directory / name}: the shards' map reads {end} bytes of it, "
                                       f"the manifest lists {listed[name].get('size')}")
