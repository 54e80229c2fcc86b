"""A source tokenized once, by every rank together, into a cache entry every later run reuses.

`open_or_build(source, ...)` (collective) returns the source's `TokenSplit`s. The entry's
name is a hash of what made it: the input files' identities (sources.py), the tokenizer
files' sha256, the row format and held-out fraction, and the entry format. A second run, a
resume or another world size finds it and reads it; a changed input file or tokenizer makes
another name, so a stale entry is never read.

Building, where no complete entry exists:
1. rank 0 takes a kernel lock on `<key>.lock`, held until the build ends (and the file removed
   just before). Where another job holds it (two jobs started on the same data), every rank of
   this one waits for that job, polling together, and reads its entry; where that job ended
   without one, this one builds it;
2. rank 0 clears the key's staging folders (no live build has one: it would hold the lock),
   makes a fresh `<key>.building-<id>` folder; every rank checks it sees that folder (the
   cache must be on a file system they share);
3. every rank tokenizes the units `u` with `u % world == rank` (unit_writer.py);
4. rank 0 waits for every unit's done-file, joins them and renames the folder to `<key>`;
   the other ranks wait for that name. Waits watch the file system, not a collective, so a
   build longer than `--dist-timeout` is no failure; an error on any rank is written into the
   staging folder, and every waiting rank raises it. A failed build's folder is removed by the
   last of its ranks to stop (each leaves a `stopped-<rank>` mark).
An entry is read only once its meta.json is there and every file has the size it states, so
a folder half-written by a killed build is never read: it is cleared and built again. On a
file system without kernel locks (Lustre mounted without `-o flock`) two jobs may both build
the entry (the first rename wins), and a killed build's folder is left in place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from ddp_amp.data.encoding import Encoder, TextFormat
from ddp_amp.data.readers import Unit, units_of
from ddp_amp.data.sources import Source
from ddp_amp.data.token_store import FORMAT, TokenSplit, complete, token_dtype
from ddp_amp.data.unit_writer import join_units, tokenize_unit, unit_done
from ddp_amp.distributed import all_gather_objects, has_peers, on_every_rank, on_rank_zero
from ddp_amp.errors import UsageError
from ddp_amp.hf import saved_call_settings, tokenizer_files

NO_FLOCK = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK})  # a file system without flock


def _digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def cache_key(source: Source, tokenizer_dir: Path, fmt: TextFormat, test_size: float,
              vocabulary: int) -> tuple[str, dict[str, Any]]:
    """(the entry's name, what made it)."""
    made_from = {"format": FORMAT, "files": source.identity(), "tokenizer": _digest(tokenizer_files(tokenizer_dir)),
                 "rows": fmt.key(), "test_size": test_size, "dtype": token_dtype(vocabulary).name}
    switched_off = saved_call_settings(tokenizer_dir)
    if switched_off:  # entries made before the encoder switched them off were cut or padded: not these
        made_from["switched_off"] = switched_off
    name = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:24]
    return name, made_from


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if has_peers() else (0, 1)


def _publish(staging: Path, rank: int, error: BaseException) -> None:
    """Leave `error` where the waiting ranks look (best effort: the raise below is what counts)."""
    with contextlib.suppress(Exception):
        (staging / f"error-{rank}.pickle").write_bytes(pickle.dumps(error))


def _raise_published(staging: Path) -> None:
    for path in sorted(staging.glob("error-*.pickle")) if staging.exists() else []:
        with contextlib.suppress(Exception):
            error = pickle.loads(path.read_bytes())
        raise error if isinstance(error, BaseException) else RuntimeError(f"a rank failed building {staging}")


def _wait(ready: Callable[[], bool], staging: Path, final: Path) -> None:
    """Until `ready()`, raising a rank's published error; the build vanishing unfinished is one too."""
    delay = 0.02
    while not ready():
        _raise_published(staging)
        if not staging.exists() and not complete(final):
            raise UsageError("--data-cache", str(staging.parent), "the tokenizing run to finish its cache entry",
                             f"{staging.name} went away unfinished (another job cleared it?); run again")
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)


def _writable(root: Path) -> None:
    """A one-line UsageError where `root` cannot be made or written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError("--data-cache", str(root), "a folder this run can write", f"{type(error).__name__}: "
                         f"{error}; pass --data-cache DIR on a shared, writable file system") from None


def _claim(final: Path, held: list[IO[bytes]]) -> str:
    """Rank 0: "done" where the entry is complete; "build" where this job is to build it (the
    lock on `<key>.lock` appended to `held`, none on a file system without flock); "wait" where
    another job holds that lock."""
    if complete(final):
        return "done"
    _writable(final.parent)
    path = _lock_path(final)
    handle = path.open("ab")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return "wait"
    except OSError as error:
        handle.close()
        if error.errno not in NO_FLOCK:
            raise
        return "build"
    try:
        current = os.stat(path).st_ino
    except FileNotFoundError:
        current = -1
    if current != os.fstat(handle.fileno()).st_ino:  # its holder removed it before letting go: look again
        handle.close()
        return "wait"
    held.append(handle)
    return "done" if complete(final) else "build"  # the job that held it may have just finished


def _lock_path(final: Path) -> Path:
    """The lock a job holds while it builds `final` (removed, still held, when it is done)."""
    return final.with_name(final.name + ".lock")


def _start_staging(root: Path, key: str, locked: bool) -> str:
    """Rank 0: clear dead builds of `key` (all of them, where this job holds the key's lock),
    set aside a broken entry, make this build's folder."""
    for old in root.glob(f"{key}.building-*") if locked else ():
        shutil.rmtree(old, ignore_errors=True)
    final = root / key
    if final.exists() and not complete(final):
        print(f"[ddp_amp] warning: {final} is an incomplete cache entry; it is set aside and built again",
              file=sys.stderr, flush=True)
        final.rename(root / f"{key}.broken-{uuid.uuid4().hex[:8]}")
    staging = root / f"{key}.building-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging.name


def _stopped(staging: Path, rank: int, world: int) -> None:
    """This rank leaves a failed build; the last one to leave removes its folder."""
    with contextlib.suppress(OSError):
        (staging / f"stopped-{rank}").write_bytes(b"")
        if all((staging / f"stopped-{other}").exists() for other in range(world)):
            shutil.rmtree(staging, ignore_errors=True)


class _Progress:
    """Rank 0's bar of its own documents and tokens per second, and the closing line."""

    def __init__(self, rank: int, world: int, what: str) -> None:
        self.rank, self.world, self.what = rank, world, what
        self.documents = self.tokens = 0
        self.started = time.perf_counter()
        self.bar: Any = None
        if rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(desc=f"tokenizing {what}", unit=" docs", file=sys.stderr, mininterval=1.0)

    def counted(self, documents: int, tokens: int) -> None:
        self.documents, self.tokens = self.documents + documents, self.tokens + tokens
        if self.bar is not None:
            self.bar.update(documents)
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s on rank 0 of {self.world}", refresh=False)

    def close(self, meta: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.rank == 0:
            seconds = time.perf_counter() - self.started
            splits = ", ".join(f"{split} {counts['documents']:,} documents, {counts['tokens']:,} tokens"
                               for split, counts in meta["splits"].items())
            rate = self.tokens / max(seconds, 1e-9)
            print(f"[ddp_amp] data: tokenized {self.what} in {seconds:.1f} s on {self.world} rank(s) "
                  f"({rate:,.0f} tokens/s on rank 0): {splits}", file=sys.stderr, flush=True)


def _build(source: Source, units: list[Unit], final: Path, made_from: dict[str, Any], encoder: Encoder,
           fmt: TextFormat, test_size: float, vocabulary: int, locked: bool) -> None:
    """Every rank: tokenize this rank's units into the staging folder rank 0 made (collective);
    `locked`: whether this job holds the key's lock."""
    rank, world = _rank_and_world()
    root, key = final.parent, final.name
    staging = root / on_rank_zero(lambda: _start_staging(root, key, locked))
    seen = all_gather_objects(staging.is_dir())
    if not all(seen):
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise UsageError("--data-cache", str(root), "a folder every rank sees (a shared file system)",
                         f"rank {seen.index(False)} does not see {staging.name}; pass --data-cache on a "
                         "file system all nodes mount")
    progress = _Progress(rank, world, source.spec)
    try:
        file_index = {file.path: i for i, file in enumerate(source.files)}
        for index in range(rank, len(units), world):
            _raise_published(staging)  # a peer's error ends this rank's share too
            unit = units[index]
            tokenize_unit(unit, index, file_index[unit.file.path], encoder, fmt, test_size,
                          token_dtype(vocabulary), staging, progress.counted)
        if rank == 0:
            _wait(lambda: all(unit_done(staging, i) for i in range(len(units))), staging, final)
            meta = join_units(staging, units, made_from, token_dtype(vocabulary), source.spec, test_size,
                              source.flag)
            try:
                staging.rename(final)
            except OSError:  # without flock, another job may have finished the same entry first: the same
                if not complete(final):
                    raise
                shutil.rmtree(staging, ignore_errors=True)
            progress.close(meta)
        else:
            _wait(lambda: complete(final), staging, final)
    except BaseException as error:
        _publish(staging, rank, error)
        _stopped(staging, rank, world)
        raise


def _build_once(source: Source, units: list[Unit], final: Path, made_from: dict[str, Any], encoder: Encoder,
                fmt: TextFormat, test_size: float, vocabulary: int) -> None:
    """Build the entry, or wait for the job that is building it (collective: the ranks poll
    together, each poll a broadcast from rank 0, so no single wait outlasts --dist-timeout)."""
    held: list[IO[bytes]] = []
    delay, told = 0.05, False
    try:
        while True:
            verdict = on_rank_zero(lambda: _claim(final, held))
            if verdict == "done":
                return
            if verdict == "build":
                _build(source, units, final, made_from, encoder, fmt, test_size, vocabulary, bool(held))
                return
            if not told and _rank_and_world()[0] == 0:
                print(f"[ddp_amp] data: {source.spec}: another job is tokenizing it into {final} (it holds "
                      f"{final.name}.lock); waiting for its entry", file=sys.stderr, flush=True)
            told = True
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)
    finally:
        for handle in held:
            _lock_path(final).unlink(missing_ok=True)  # before the release: a waiter that then takes
            handle.close()  # the removed file's lock sees it is no longer the path's and looks again


def open_or_build(source: Source, tokenizer: Any, tokenizer_dir: Path, fmt: TextFormat, test_size: float,
                  root: Path) -> tuple[TokenSplit, TokenSplit | None]:
    """The source's (train, eval) splits, tokenized into `root` where no entry exists
    (collective: call on every rank, in the same order); eval is None without `test_size`."""
    vocabulary = len(tokenizer)
    key, made_from = on_every_rank(lambda: cache_key(source, tokenizer_dir, fmt, test_size, vocabulary))
    final = root / key
    seen = all_gather_objects((key, complete(final)))
    if len({k for k, _ in seen}) > 1:
        raise UsageError(source.flag, source.spec, "the same files (and sizes, mtimes) on every rank",
                         "ranks see different inputs or tokenizers: put them on a file system every rank shares")
    if not all(done for _, done in seen):
        units = on_every_rank(lambda: [unit for file in source.files for unit in units_of(file, fmt.sample_by)])
        _build_once(source, units, final, made_from, Encoder(tokenizer, fmt, source.flag), fmt, test_size,
                    vocabulary)
    train = TokenSplit(final, "train")
    return train, TokenSplit(final, "eval") if "eval" in train.meta["splits"] else None
