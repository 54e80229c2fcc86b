"""A file written and hashed in one pass: the size and sha256 a manifest records, without
reading the file back.

`HashingStream` wraps an open binary file; what is written through it is hashed and counted
on its way out. Every writer of a checkpoint goes through it: rank 0's files
(`write_hashed`), each rank's own RNG file and record (rank_files.py) and each rank's DCP
shards (shard_writer.py), so no rank re-reads what it wrote to learn its hash.

It also keeps a write's OSError: torch.save turns a failed write into a RuntimeError without
the errno ("unexpected pos ..."); keeping the original lets a full disk be reported as a full
disk.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ddp_amp.checkpoint.manifest import FileRecord


class HashingStream:
    """A binary file, written front to back, whose bytes are hashed and counted as they pass.

    Only what a sequential writer needs (write, flush, tell, fileno, close): no seek, so
    nothing can rewrite bytes already hashed.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self.handle.write(data)
        except OSError as error:
            self.error = error
            raise
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.handle.flush()

    def tell(self) -> int:
        return self.handle.tell()

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()

    def record(self) -> FileRecord:
        """What the manifest lists for the file: its size and sha256."""
        return {"size": self.size, "sha256": self.digest.hexdigest()}


def write_hashed(path: Path, payload: Any) -> FileRecord:
    """Write `payload` (bytes as they are, anything else through torch.save) to `path`,
    fsync it, and return its size and sha256, hashed on the way out."""
    with open(path, "wb") as handle:
        stream = HashingStream(handle)
        if isinstance(payload, bytes):
            stream.write(payload)
        else:
            try:
                torch.save(payload, stream)  # type: ignore[arg-type]  # torch.save uses only write() and flush()
            except RuntimeError:
                if stream.error is not None:
                    raise stream.error from None
                raise
        handle.flush()
        os.fsync(handle.fileno())
    return stream.record()
