"""Reading users' files (ddp_amp/data/sources.py, readers.py): every format gives its rows in
order, a file cut into units gives the same rows whoever reads each unit, and bad input is
one line naming the file and the line."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import pytest

from ddp_amp.data import readers
from ddp_amp.data.readers import read_rows, units_of
from ddp_amp.data.sources import resolve_source, split_weight
from ddp_amp.errors import UsageError

ROWS = [{"text": f"document {i} " + "word " * (i % 7), "n": i} for i in range(50)]


def _rows_of(spec: str, sample_by: str = "line", flag: str = "--data") -> list[dict[str, object]]:
    source = resolve_source(spec, flag)
    return [row for file in source.files for unit in units_of(file, sample_by) for _, row in read_rows(unit, sample_by)]


def _jsonl(rows: list[dict[str, object]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


@pytest.mark.parametrize("name,write", [
    ("d.jsonl", lambda path, data: path.write_bytes(data)),
    ("d.jsonl.gz", lambda path, data: path.write_bytes(gzip.compress(data))),
    ("d.jsonl.bz2", lambda path, data: path.write_bytes(bz2.compress(data))),
    ("d.json.xz", lambda path, data: path.write_bytes(lzma.compress(data))),
])
def test_json_lines_plain_and_compressed(tmp_path: Path, name: str, write: object) -> None:
    write(tmp_path / name, _jsonl(ROWS))  # type: ignore[operator]
    assert _rows_of(str(tmp_path / name)) == ROWS


def test_a_json_array_parquet_and_a_datasets_folder(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    assert _rows_of(str(tmp_path / "a.json")) == ROWS
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet", row_group_size=8)
    assert len(units_of(resolve_source(str(tmp_path / "p.parquet"), "--data").files[0], "line")) == 7
    assert _rows_of(str(tmp_path / "p.parquet")) == ROWS
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert _rows_of(str(tmp_path / "saved")) == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(UsageError, match=r"name one split's folder, e.g. .*dict/train"):
        resolve_source(str(tmp_path / "dict"), "--data")


def test_text_files_by_line_paragraph_and_document(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("first line\nsecond line\n\nthird, after a blank\n")
    assert [r["text"] for r in _rows_of(str(tmp_path / "t.txt"))] == ["first line", "second line", "",
                                                                        "third, after a blank"]
    assert [r["text"] for r in _rows_of(str(tmp_path / "t.txt"), "paragraph")] == [
        "first line\nsecond line", "third, after a blank\n"]
    assert [r["text"] for r in _rows_of(str(tmp_path / "t.txt"), "document")] == [
        "first line\nsecond line\n\nthird, after a blank\n"]


def test_a_large_line_file_is_cut_into_units_whose_rows_join_up(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readers, "UNIT_BYTES", 97)  # so a small file has many units, cut mid-line
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl(ROWS))
    file = resolve_source(str(path), "--data").files[0]
    units = units_of(file, "line")
    assert len(units) > 10
    assert [row for unit in units for _, row in read_rows(unit)] == ROWS
    assert readers.where(units[-1], next(read_rows(units[-1]))[0]).endswith(
        f", line {ROWS.index(next(read_rows(units[-1]))[1]) + 1}")


def test_globs_are_sorted_and_weights_parsed(tmp_path: Path) -> None:
    for name in ("b.jsonl", "a.jsonl"):
        (tmp_path / name).write_bytes(_jsonl(ROWS[:2]))
    source = resolve_source(f"{tmp_path}/*.jsonl:0.5", "--data")
    assert [Path(f.path).name for f in source.files] == ["a.jsonl", "b.jsonl"] and source.weight == 0.5
    assert split_weight("dir/file:name.jsonl", "--data") == ("dir/file:name.jsonl", 1.0)
    with pytest.raises(UsageError, match="weight > 0"):
        split_weight("a.jsonl:0", "--data")


@pytest.mark.parametrize("content,message", [
    (b'{"text": "ok"}\n{"text": "also"}\n{"text": broken}\n', r"d\.jsonl, line 3': expected one JSON object per line"),
    (b'{"text": "ok"}\n["a list"]\n', r"d\.jsonl, line 2': expected one JSON object per line"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"d\.jsonl, line 2': expected UTF-8 text"),
])
def test_an_unreadable_row_is_named_by_file_and_line(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "d.jsonl").write_bytes(content)
    with pytest.raises(UsageError, match=message):
        _rows_of(str(tmp_path / "d.jsonl"))


def test_a_row_error_names_the_option_of_its_source_and_says_at_once(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "unterminated\n')
    with pytest.raises(UsageError) as raised:
        _rows_of(str(tmp_path / "d.jsonl"), flag="--eval-data")
    assert str(raised.value).startswith("--eval-data=") and "d.jsonl, line 2" in str(raised.value)
    assert str(raised.value).endswith("(hint: Invalid control character at column 23)")  # not "at at"


def test_missing_and_unknown_inputs_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="expected an existing file, glob or datasets folder"):
        resolve_source(str(tmp_path / "nothing*.jsonl"), "--data")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UsageError, match=r"d\.csv': expected a \.jsonl, \.json, \.parquet or \.txt file"):
        resolve_source(str(tmp_path / "d.csv"), "--data")
    (tmp_path / "folder").mkdir()
    with pytest.raises(UsageError, match="expected a datasets save_to_disk folder"):
        resolve_source(str(tmp_path / "folder"), "--eval-data")
