"""The manifest: what makes a checkpoint directory complete, and how that is checked.

`manifest.json` is the last file written into a checkpoint's temporary directory. It lists
every other file with its size and sha256, so a reader can tell a complete checkpoint from
a torn one (killed mid-write, truncated by a full disk, bit rot) before unpickling anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ddp_amp.checkpoint.sharded_reader import SafeShardReader
from ddp_amp.errors import UsageError

MANIFEST_NAME = "manifest.json"
SHARDED_DIR = "sharded"  # a sharded checkpoint's DCP folder, and in it DCP's map of the shards
MAP_FILE = ".metadata"
FORMAT_VERSION = 1
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
    if manifest.get("format") != FORMAT_VERSION:
        raise IncompleteCheckpoint(f"{directory}: manifest format {manifest.get('format')!r}, "
                                   f"this ddp_amp reads format {FORMAT_VERSION}")
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


def verify_checkpoint(directory: Path, check_hashes: bool = True) -> dict[str, Any]:
    """Check every listed file's size (and sha256); return the manifest or raise IncompleteCheckpoint."""
    manifest = read_manifest(directory)
    for name, expected in manifest["files"].items():
        check_listed_file(directory / name, expected, check_hashes)
    _check_shard_map(directory, manifest["files"])
    return manifest


def _check_shard_map(directory: Path, listed: dict[str, Any]) -> None:
    """A sharded checkpoint's map names only files the manifest lists, and reads within them:
    a shard file gone or cut short, with a manifest made to match, is caught here rather than
    in DCP's read on every rank."""
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
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        if name not in listed:
            raise IncompleteCheckpoint(f"{directory / name}: named by the shards' map but not in the manifest")
        if end > int(listed[name].get("size", 0)):
            raise IncompleteCheckpoint(f"{directory / name}: the shards' map reads {end} bytes of it, "
                                       f"the manifest lists {listed[name].get('size')}")
