"""The tokenized cache (ddp_amp/data/token_cache.py): built once by every rank together, reused
by later runs, never stale, never read half-written; and its failures, one line each."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddp_amp.data.encoding import TextFormat
from ddp_amp.data.sources import resolve_source
from ddp_amp.data.token_cache import open_or_build
from ddp_amp.data.token_store import TokenSplit
from ddp_amp.errors import UsageError
from tests.multiproc import kill_when, run_ranks, slow_writes_env
from tests.text_model import corpus_documents, make_model_dir, write_jsonl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"), vocab_size=400, width=32, layers=1, heads=2)


def _corpus(folder: Path, files: int = 3) -> str:
    """`files` JSON lines files of documents; a glob naming them all."""
    folder.mkdir(exist_ok=True)
    documents = corpus_documents(60)
    for index in range(files):
        write_jsonl(folder / f"part-{index}.jsonl", [{"text": d} for d in documents[index::files]])
    return f"{folder}/part-*.jsonl"


def build(spec: str, model_dir: Path, root: Path, **fmt: Any) -> TokenSplit:
    from transformers import AutoTokenizer
    train, _ = open_or_build(resolve_source(spec, "--data"), AutoTokenizer.from_pretrained(model_dir), model_dir,
                             TextFormat(**fmt), 0.0, root)
    return train


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_a_later_run_reuses_the_entry_and_any_change_makes_another(tmp_path: Path, model_dir: Path,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    spec, root = _corpus(tmp_path / "data"), tmp_path / "cache"
    first = build(spec, model_dir, root)
    assert "tokenized" in capfd.readouterr().err
    stamp = (first.folder / "train.tokens").stat().st_mtime_ns
    again = build(spec, model_dir, root)
    assert again.folder == first.folder and (again.folder / "train.tokens").stat().st_mtime_ns == stamp
    assert "tokenized" not in capfd.readouterr().err and sorted(p.name for p in root.iterdir()) == [first.folder.name]
    assert build(spec, model_dir, root, assistant_only_loss=False).folder != first.folder  # the row options count

    changed = tmp_path / "data" / "part-1.jsonl"
    changed.write_text(changed.read_text().replace("the", "THE"))  # same size, other text
    after_edit = build(spec, model_dir, root)
    assert after_edit.folder != first.folder and after_edit.tokens != first.tokens
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    try:
        assert build(spec, model_dir, root).folder not in (first.folder, after_edit.folder)
    finally:
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("setting", [{"truncation": True, "max_length": 16}, {"padding": "longest"}])
def test_a_truncation_or_padding_saved_with_the_tokenizer_changes_no_token(tmp_path: Path, model_dir: Path,
                                                                          setting: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    # A tokenizer called with truncation=True or padding= and then saved keeps that setting in
    # its tokenizer.json; encoding must still give what tokenizer(text) gives.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer(["a first document", "and a second, longer one"], **setting)
    saved = tmp_path / "saved"
    tokenizer.save_pretrained(saved)
    backend = AutoTokenizer.from_pretrained(saved).backend_tokenizer
    assert (backend.truncation, backend.padding) != (None, None)  # the setting came back with the files
    spec = _corpus(tmp_path / "data")
    entry = build(spec, saved, tmp_path / "cache").folder
    plain = build(spec, model_dir, tmp_path / "cache").folder
    for name in ("train.tokens", "train.offsets", "train.rows"):
        assert (entry / name).read_bytes() == (plain / name).read_bytes(), name
    # An entry that an encoder which kept the setting made (cut or padded) is not this one's.
    assert json.loads((entry / "meta.json").read_text())["made_from"]["switched_off"] == list(setting)[:1]
    with_eos = AutoTokenizer.from_pretrained(model_dir)
    first = TokenSplit(entry, "train")
    assert first.token_slice(0, int(first.offsets[1])).tolist() == \
        with_eos(corpus_documents(60)[0])["input_ids"] + [with_eos.eos_token_id]


_BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tests.test_text_cache import build
    while len(sys.argv) > 4 and not any(Path(sys.argv[3]).glob(sys.argv[4])):  # a glob to wait for first
        time.sleep(0.02)
    print(build(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])).folder.name, flush=True)
""")


def test_a_build_killed_midway_is_never_read_and_is_built_again(tmp_path: Path, model_dir: Path) -> None:
    spec, root = _corpus(tmp_path / "data", files=4), tmp_path / "cache"
    builder = subprocess.Popen([sys.executable, "-c", _BUILDER, spec, str(model_dir), str(root)],
                               env=slow_writes_env(30, inside=".building-"), text=True)
    kill_when(builder, lambda: any(root.glob("*.building-*/unit-*.tokens")), "a unit being written")
    (dead,) = root.glob("*.building-*")
    assert not any(path.is_dir() and ".building-" not in path.name for path in root.iterdir())  # nothing to read
    rebuilt = build(spec, model_dir, root)
    assert not dead.exists()  # its lock was free: a dead build's folder, cleared
    assert _files(rebuilt.folder) == _files(build(spec, model_dir, tmp_path / "clean").folder)


def _until(ready: Callable[[], bool], proc: subprocess.Popen[str], what: str, timeout: float = 120) -> None:
    """Poll `ready()` until it holds; fail where `proc` ends first (or `timeout` passes: a hang)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, f"never reached {what}"
        time.sleep(0.02)


def test_a_second_job_on_the_same_data_waits_for_the_first_and_reads_its_entry(tmp_path: Path,
                                                                               model_dir: Path) -> None:
    spec, root, gate = _corpus(tmp_path / "data"), tmp_path / "cache", tmp_path / "gate"
    builder = [sys.executable, "-c", _BUILDER, spec, str(model_dir), str(root)]
    # The first job's writes into its staging folder wait for the gate: it holds the entry's lock.
    first = subprocess.Popen(builder, env=slow_writes_env(0, inside=".building-",
                                                          DDP_AMP_TEST_SLOW_WRITES_UNTIL=str(gate)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second_err = tmp_path / "second.err"
    with second_err.open("w") as err:  # started together (imports take seconds); it builds once the first does
        second = subprocess.Popen([*builder, "*.building-*/unit-*"], env=slow_writes_env(0), stdout=subprocess.PIPE,
                                  stderr=err, text=True)
    try:
        # Ending without that line would mean it did not wait: it tokenized everything too.
        _until(lambda: "waiting for its entry" in second_err.read_text(), second, "the second job waiting")
    finally:
        gate.touch()
        first_out, first_log = first.communicate(timeout=120)
    second_out, _ = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first_log[-2000:] + second_err.read_text()[-2000:]
    assert "tokenized" in first_log and "tokenized" not in second_err.read_text()  # one job tokenized
    assert first_out == second_out and [p.name for p in root.iterdir() if p.is_dir()] == [first_out.strip()]


def test_a_file_system_without_flock_still_builds(tmp_path: Path, model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    def no_flock(fd: object, operation: int) -> None:  # what Lustre without -o flock answers
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    spec = _corpus(tmp_path / "data")
    expected = _files(build(spec, model_dir, tmp_path / "locked").folder)
    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert _files(build(spec, model_dir, tmp_path / "cache").folder) == expected


def test_an_incomplete_entry_is_set_aside_and_built_again(tmp_path: Path, model_dir: Path,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    spec, root = _corpus(tmp_path / "data"), tmp_path / "cache"
    entry = build(spec, model_dir, root).folder
    whole = _files(entry)
    with (entry / "train.tokens").open("r+b") as tokens:
        tokens.truncate(100)
    assert _files(build(spec, model_dir, root).folder) == whole
    assert "incomplete cache entry" in capfd.readouterr().err and len(list(root.glob("*.broken-*"))) == 1


def test_an_unusable_cache_folder_is_one_line(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"--data-cache=.*file/cache'?: expected a folder this run can write"):
        build(_corpus(tmp_path / "data"), model_dir, tmp_path / "file" / "cache")


def test_a_bad_row_of_an_eval_source_names_eval_data(tmp_path: Path, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    held = write_jsonl(tmp_path / "held.jsonl", [{"text": "fine"}, {"txt": "no text field"}])
    with pytest.raises(UsageError, match=r"^--eval-data=.*held\.jsonl, line 2'?: expected rows with a 'text' field"):
        open_or_build(resolve_source(str(held), "--eval-data"), AutoTokenizer.from_pretrained(model_dir), model_dir,
                      TextFormat(), 0.0, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # the refused build's staging folder and lock are gone


def _build_on_ranks(ctx: object, spec: str, model_dir: Path, root: Path) -> dict[str, bytes] | str:
    try:
        return _files(build(spec, model_dir, root).folder)
    except UsageError as error:
        return f"UsageError: {error}"


def test_ranks_share_the_build_and_a_bad_row_on_rank_1_stops_both(tmp_path: Path, model_dir: Path) -> None:
    spec = _corpus(tmp_path / "data", files=5)
    shared = run_ranks(_build_on_ranks, 2, spec, model_dir, tmp_path / "two")
    assert shared[0] == shared[1] == _files(build(spec, model_dir, tmp_path / "one").folder)
    (shared_entry,) = [path.name for path in (tmp_path / "two").iterdir()]
    bad = tmp_path / "data" / "part-3.jsonl"  # the fourth unit: rank 1's
    bad.write_text(bad.read_text() + '{"text": "fine"}\n{"txt": "no text field"}\n')
    failed = run_ranks(_build_on_ranks, 2, spec, model_dir, tmp_path / "two")
    lines = len(bad.read_text().splitlines())
    assert failed[0] == failed[1] and f"part-3.jsonl, line {lines}" in str(failed[0])
    assert "expected rows with a 'text' field" in str(failed[0])
    assert [path.name for path in (tmp_path / "two").iterdir()] == [shared_entry]  # nothing of the refused build
