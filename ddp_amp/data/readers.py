"""Reading the rows of an input file, a part at a time, so that ranks can share one file.

A file is cut into units (`units_of`): an uncompressed line file (JSON lines, text by line)
into byte ranges of about `UNIT_BYTES`, each holding the lines that start in it; a parquet
file into its row groups; a `datasets` folder into ranges of `ARROW_ROWS` rows; anything else
(a compressed file, a JSON array, text by paragraph or document) is one unit. The units of a
file, read in order, give its rows in order, whoever reads each.

`read_rows(unit)` yields `(locator, row)`: the row as a dict, and where it is (the byte offset
of its line in the file, decompressed, or its row or item number). `where(unit, locator)`
turns that into the words an error shows: "FILE, line N" (counted only then: a unit in the
middle of a large file does not count the lines before it while it is read), "FILE, row N".
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from ddp_amp.data.sources import SourceFile
from ddp_amp.errors import UsageError

UNIT_BYTES = 64 << 20
ARROW_ROWS = 50_000
SAMPLE_BY = ("line", "paragraph", "document")


@dataclass(frozen=True)
class Unit:
    """Part `part` of `parts` of one input file."""

    file: SourceFile
    part: int
    parts: int

    def to_list(self) -> list[Any]:
        """What a cache entry's meta.json records of the unit, to name its rows later."""
        return [self.file.path, self.file.format, self.file.compression, self.part, self.parts]

    @classmethod
    def from_list(cls, raw: list[Any]) -> Unit:
        path, fmt, compression, part, parts = raw
        return cls(SourceFile(path, fmt, compression, 0, 0), part, parts)


def _open(file: SourceFile) -> IO[bytes]:
    """The file's bytes, decompressed."""
    if file.compression == ".gz":
        return gzip.open(file.path, "rb")  # type: ignore[return-value]  # a GzipFile is a binary stream
    if file.compression == ".bz2":
        return bz2.open(file.path, "rb")
    if file.compression == ".xz":
        return lzma.open(file.path, "rb")
    if file.compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raise UsageError(file.flag, file.path, "the zstandard package installed, for .zst files",
                             "pip install zstandard, or decompress the file") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(file.path, "rb")))
    return open(file.path, "rb")


def _is_json_array(file: SourceFile) -> bool:
    with _open(file) as stream:
        head = stream.read(4096).lstrip()
    return head.startswith(b"[")


def units_of(file: SourceFile, sample_by: str) -> list[Unit]:
    """The units `file` is read in (cheap: sizes and metadata only)."""
    if file.format == "parquet":
        import pyarrow.parquet as pq
        parts = pq.ParquetFile(file.path).metadata.num_row_groups
    elif file.format == "arrow":
        parts = math.ceil(_arrow_dataset(file).num_rows / ARROW_ROWS)
    elif file.compression or (file.format == "text" and sample_by != "line") or \
            (file.format == "json" and _is_json_array(file)):
        parts = 1
    else:
        parts = max(1, math.ceil(file.size / UNIT_BYTES))
    return [Unit(file, part, parts) for part in range(max(parts, 1))]


def _arrow_dataset(file: SourceFile) -> Any:
    try:
        import datasets
    except ImportError:
        raise UsageError(file.flag, file.path, "the datasets package installed, to read a save_to_disk folder",
                         "pip install 'ddp_amp[text]'") from None
    return datasets.load_from_disk(file.path)


def _lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of the lines that start in the unit's byte range."""
    file = unit.file
    with _open(file) as stream:
        if unit.parts == 1:
            position = 0
            for line in stream:
                yield position, line
                position += len(line)
            return
        start, end = file.size * unit.part // unit.parts, file.size * (unit.part + 1) // unit.parts
        if start > 0:  # the line running through `start` belongs to the unit before
            stream.seek(start - 1)
            stream.readline()
        position = stream.tell()
        while position < end:
            line = stream.readline()
            if not line:
                return
            yield position, line
            position += len(line)


def _decoded(unit: Unit, locator: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(unit.file.flag, where(unit, locator), "UTF-8 text",
                         f"byte {error.start} of the row is {raw[error.start:error.start + 1]!r}; re-encode the "
                         "file as UTF-8 (iconv -f latin1 -t utf-8)") from None


def _json_rows(unit: Unit) -> Iterator[tuple[int, dict[str, Any]]]:
    if unit.parts == 1 and _is_json_array(unit.file):
        with _open(unit.file) as stream:
            items = json.loads(_decoded(unit, 0, stream.read()))
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                raise UsageError(unit.file.flag, f"{unit.file.path}, item {index}", "a JSON object per item",
                                 f"got {type(item).__name__}")
            yield index, item
        return
    for offset, raw in _lines(unit):
        if not raw.strip():
            continue
        try:
            row = json.loads(_decoded(unit, offset, raw))
        except json.JSONDecodeError as error:
            # Some of json's messages end in "at" ("Unterminated string starting at"): one "at" here.
            raise UsageError(unit.file.flag, where(unit, offset), "one JSON object per line",
                             f"{error.msg.removesuffix(' at')} at column {error.colno}") from None
        if not isinstance(row, dict):
            raise UsageError(unit.file.flag, where(unit, offset), "one JSON object per line",
                             f"got {type(row).__name__}")
        yield offset, row


def _text_rows(unit: Unit, sample_by: str) -> Iterator[tuple[int, dict[str, Any]]]:
    if sample_by == "line":
        for offset, raw in _lines(unit):
            yield offset, {"text": _decoded(unit, offset, raw).rstrip("\r\n")}
        return
    with _open(unit.file) as stream:
        whole = _decoded(unit, 0, stream.read())
    if sample_by == "document":
        yield 0, {"text": whole}
        return
    offset = 0
    for paragraph in whole.split("\n\n"):  # datasets' text loader splits paragraphs so
        if paragraph.strip():
            yield offset, {"text": paragraph}
        offset += len(paragraph.encode()) + 2


def _table_rows(unit: Unit, columns: list[str] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    if unit.file.format == "parquet":
        import pyarrow.parquet as pq
        parquet = pq.ParquetFile(unit.file.path)
        first = sum(parquet.metadata.row_group(g).num_rows for g in range(unit.part))
        present = [c for c in columns if c in parquet.schema_arrow.names] if columns else None
        table = parquet.read_row_group(unit.part, columns=present)
    else:
        dataset = _arrow_dataset(unit.file)
        first = unit.part * ARROW_ROWS
        present = [c for c in columns if c in dataset.column_names] if columns else None
        table = dataset.with_format("arrow")[first:first + ARROW_ROWS]
        table = table.select(present) if present is not None else table
    for index, row in enumerate(table.to_pylist()):
        yield first + index, row


def read_rows(unit: Unit, sample_by: str = "line",
              columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """The unit's rows in order, as (locator, row); `columns`: of a table format, those to read."""
    if unit.file.format == "json":
        return _json_rows(unit)
    if unit.file.format == "text":
        return _text_rows(unit, sample_by)
    return _table_rows(unit, columns)


def where(unit: Unit, locator: int) -> str:
    """Where a row is, for an error: 'FILE, line N', or 'FILE, row N' of a table format."""
    file = unit.file
    if file.format in ("parquet", "arrow"):
        return f"{file.path}, row {locator}"
    if file.format == "json" and unit.parts == 1 and _is_json_array(file):
        return f"{file.path}, item {locator}"
    lines, read = 1, 0
    with _open(file) as stream:  # counted only for an error: a full read up to the row
        while read < locator:
            chunk = stream.read(min(1 << 20, locator - read))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            read += len(chunk)
    return f"{file.path}, line {lines}"
