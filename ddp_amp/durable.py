"""Writes that survive a crash or a power cut: fsync, then an atomic rename.

Every file ddp_amp replaces (config.json, summary.json, a rewritten metrics.jsonl, the
files of a checkpoint) goes through here, so a reader finds the old content or the new,
never half of one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, content: bytes | str | Callable[[BinaryIO], None]) -> None:
    """Replace `path` with `content`: a temporary file beside it, fsync, rename, fsync the folder.

    `content` is bytes, text (UTF-8), or a function that writes into the open binary
    handle (e.g. `lambda f: torch.save(obj, f)`). On failure `path` keeps its old content
    and the temporary file is removed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(scratch, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode() if isinstance(content, str) else content)
            handle.flush()
            # fsync before the rename: otherwise a power loss can leave the new name
            # pointing at a file whose data never reached the disk.
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)
    fsync_dir(path.parent)
