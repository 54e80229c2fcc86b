"""Where text comes from: `--data` / `--eval-data` specs, the files they name, and each file's
identity (what a tokenized cache is keyed by).

A spec is `PATH[:WEIGHT]`: a file, a glob (`shards/*.jsonl.gz`), or a folder written by
`datasets`' `Dataset.save_to_disk`; WEIGHT (default 1) is how many times the source's
windows are used per epoch (0.5: half of them, 3: each three times). Formats, by suffix:
`.jsonl`/`.json`/`.ndjson` (JSON lines, or one JSON array of objects), `.parquet`, `.txt`
(lines, paragraphs or the whole file per document, as `datasets`' text loader's `sample_by`),
each of the line formats also compressed as `.gz`, `.bz2`, `.xz` (the standard library's
readers) or `.zst` (where the `zstandard` package is installed).

A file's identity is its absolute path, size and modification time (ns), not a hash of its
content: hashing terabytes of text on every launch would cost minutes, while any rewrite of
a file changes its mtime (a tool that restores the mtime of a changed file of the same size
would defeat it; delete the cache folder then).
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ddp_amp.errors import UsageError

COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".txt": "text",
           ".text": "text"}
DATASET_STATE = "state.json"  # what Dataset.save_to_disk writes beside its arrow files


@dataclass(frozen=True)
class SourceFile:
    """One input file (or `datasets` folder) and its identity."""

    path: str  # absolute
    format: str  # json | parquet | text | arrow (a datasets folder)
    compression: str  # "" or one of COMPRESSIONS
    size: int
    mtime_ns: int
    flag: str = "--data"  # the option that named it (--data or --eval-data), for errors about its rows

    def identity(self) -> list[object]:
        return [self.path, self.size, self.mtime_ns]


@dataclass(frozen=True)
class Source:
    """One `--data` spec: its files, in sorted order, and its weight."""

    spec: str
    files: tuple[SourceFile, ...]
    weight: float
    flag: str = "--data"  # or --eval-data

    def identity(self) -> list[object]:
        """What the tokenized cache of this source is keyed by (not the weight: it is applied
        to the windows, after tokenizing)."""
        return [file.identity() for file in self.files]


def split_weight(spec: str, flag: str) -> tuple[str, float]:
    """'data/*.jsonl:2' -> ('data/*.jsonl', 2.0); a path whose last ':' is not followed by a
    number is all path."""
    path, colon, tail = spec.rpartition(":")
    if not colon or not path:
        return spec, 1.0
    try:
        weight = float(tail)
    except ValueError:
        return spec, 1.0
    if not (math.isfinite(weight) and weight > 0):
        raise UsageError(flag, spec, "PATH or PATH:WEIGHT with a weight > 0 (times per epoch)",
                         f"e.g. {flag} {path}:0.5 uses half of its windows each epoch")
    return path, weight


def _format_of(path: Path, flag: str, spec: str) -> tuple[str, str]:
    name = path.name.lower()
    compression = next((suffix for suffix in COMPRESSIONS if name.endswith(suffix)), "")
    stem_suffix = Path(name[:len(name) - len(compression)]).suffix
    if stem_suffix not in FORMATS:
        raise UsageError(flag, str(path), "a .jsonl, .json, .parquet or .txt file (optionally .gz, .bz2, .xz, "
                         ".zst), or a datasets save_to_disk folder", f"rename the file or convert it ({spec})")
    if compression and FORMATS[stem_suffix] == "parquet":
        raise UsageError(flag, str(path), "an uncompressed .parquet file (parquet compresses its own pages)",
                         "decompress it, or write it with parquet's own compression")
    return FORMATS[stem_suffix], compression


def _dataset_folder(path: Path, flag: str) -> SourceFile:
    """A `save_to_disk` folder as one input: its arrow files' identities stand for it."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise UsageError(flag, str(path), "a Dataset folder (a DatasetDict holds several)",
                         f"name one split's folder, e.g. {path / (splits[0] if splits else 'train')}")
    if not (path / DATASET_STATE).exists():
        raise UsageError(flag, str(path), f"a datasets save_to_disk folder (with {DATASET_STATE}) or a file",
                         "give the files themselves, e.g. DIR/*.jsonl")
    arrows = sorted(path.glob("*.arrow"))
    stats = [arrow.stat() for arrow in arrows]
    return SourceFile(str(path.resolve()), "arrow", "", sum(s.st_size for s in stats),
                      max((s.st_mtime_ns for s in stats), default=0), flag)


def resolve_source(spec: str, flag: str) -> Source:
    """The files `spec` names, each with its identity; a one-line UsageError where it names none."""
    pattern, weight = split_weight(spec, flag)
    pattern = os.path.expanduser(pattern)
    names = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    paths = [Path(name) for name in names if Path(name).exists()]
    if not paths:
        raise UsageError(flag, spec, "an existing file, glob or datasets folder",
                         f"nothing matches {pattern!r} (relative paths start at {os.getcwd()})")
    files = []
    for path in paths:
        if path.is_dir():
            files.append(_dataset_folder(path, flag))
            continue
        fmt, compression = _format_of(path, flag, spec)
        try:
            stat = path.stat()
            with path.open("rb"):
                pass
        except OSError as error:
            raise UsageError(flag, str(path), "a readable file", f"{type(error).__name__}: {error}") from None
        files.append(SourceFile(str(path.resolve()), fmt, compression, stat.st_size, stat.st_mtime_ns, flag))
    return Source(spec, tuple(files), weight, flag)
