"""DCP's file writer, hashing each shard file as it writes it.

Each rank writes its shards with torch.distributed.checkpoint. `HashingShardWriter` is DCP's
`FileSystemWriter` whose file system hands DCP a `HashingStream` (hashed_write.py) for every
file it creates, so a rank knows the size and sha256 of each of its files the moment DCP
closes it: no listing of the shared folder, which holds every rank's files, and no reading
back. Rank 0's map of the shards, written as `.metadata.tmp` and renamed, is followed through
the rename; it is rank 0's to list in the manifest (`map_record`), as every rank reads it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from ddp_amp.checkpoint.hashed_write import HashingStream
from ddp_amp.checkpoint.manifest import MAP_FILE, SHARDED_DIR, FileRecord
from ddp_amp.torch_api import AsyncSaveResponse


class _HashingFileSystem(FileSystem):
    """DCP's local file system, keeping the record of every file it writes, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, FileRecord] = {}
        self._lock = threading.Lock()  # DCP may write several files at once, a thread each

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb":  # DCP writes with "wb" only; anything else is a read
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as handle:
            hashing = HashingStream(handle)
            yield hashing
        with self._lock:
            self.records[Path(path).name] = hashing.record()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            moved = self.records.pop(Path(path).name, None)
            if moved is not None:
                self.records[Path(new_path).name] = moved

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        with self._lock:
            self.records.pop(Path(path).name, None)


class HashingShardWriter(FileSystemWriter):
    """DCP's writer into folder `path` (a checkpoint's `sharded/`) that records what it wrote."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._files = _HashingFileSystem()
        self.fs = self._files

    def shard_records(self) -> dict[str, FileRecord]:
        """This rank's shard files, by checkpoint-relative name, with their size and sha256."""
        return {f"{SHARDED_DIR}/{name}": record for name, record in self._files.records.items() if name != MAP_FILE}

    def map_record(self) -> dict[str, FileRecord]:
        """The shards' map, where this rank wrote it (rank 0), by checkpoint-relative name."""
        record = self._files.records.get(MAP_FILE)
        return {f"{SHARDED_DIR}/{MAP_FILE}": record} if record is not None else {}


def write_shards(writer: HashingShardWriter, state: dict[str, Any]) -> dict[str, FileRecord]:
    """Write this rank's part of `state` through `writer` (DCP's save, collective) and return
    the records of its shard files."""
    dcp.save(state, storage_writer=writer)
    return writer.shard_records()


class BackgroundShards:
    """This rank's shards being written in the background: DCP's async save (collective) on
    `group`, a process group of the saves' own, since training's collectives go on meanwhile."""

    def __init__(self, folder: Path, state: dict[str, Any], group: Any) -> None:
        self.writer = HashingShardWriter(folder)
        saving = dcp.async_save(state, storage_writer=self.writer, process_group=group)
        # A plain Future without an async stager (none is given); with one, the upload's own.
        self._future = saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving

    def records(self) -> dict[str, FileRecord]:
        """Wait for this rank's shards; the records of its shard files (DCP's error raised)."""
        self._future.result()
        return self.writer.shard_records()
