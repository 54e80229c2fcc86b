"""Rank 0's share of a save and of a resume, at 64 to 16,384 emulated ranks: flat in N.

    python -m ddp_amp.bench --sections resume --check   # with --resume-ranks 64,4096,16384

Every rank of a real job writes and hashes its own files, and rank 0 gathers one fixed-size
report per rank (checkpoint/save.py, verify.py). Here the code rank 0 runs is the real code,
called in this process as it is called on rank 0, with N ranks' files on local disk:
- save: `prepare` (the checks, the scratch directory), rank 0's own files
  (`write_own_files`), then, once ranks 1..N-1 have written theirs (each with the same
  `write_own_files`, from a pool of threads, not counted: they are other ranks' work), the
  reports as their exchange hands them to rank 0 (`Reports.of`: the exchange's all-reduces
  carry EXCHANGE_BYTES through each rank whatever N, and are not counted) and the commit
  (`commit_reported`, with retention keeping the newest checkpoint: it renames the one it
  lets go aside);
- retention: the deletion of the checkpoint that commit let go, which runs in threads while
  training goes on: ranks 1..N-1 delete their own files of it (`delete_rank_files`, from the
  pool, not counted, their time reported apart), then rank 0 its own (`let_go_own`) and what
  is left (`end`, the same removal its thread runs at the next commit), counted; done here
  before the next save, so that it never shares the disk with that save's counted work
  (measured: a deletion running beside it made rank 0's save 2.5x slower at 16,384 ranks);
- resume: the candidates (`candidate_dirs`), rank 0's share of the check
  (`check_own_files`), the reports of ranks 1..N-1 as exchanged (each the leaf of its record,
  what its own check reports for a whole checkpoint; a sample of them is checked by the real
  `check_own_files` first), the verdict (`verdict`) and rank 0's read (`read_checkpoint`).
Counted on rank 0 (file_ops.py): its time, its file-system calls and the directory entries
it reads, each a median over repeats, the world sizes interleaved in one run. Targets
(`--check`), at the largest N against the smallest: file operations and directory entries
at most 1x at save, at resume and for retention's deletion: counts, which the machine's
load does not change. Rank 0's time is reported beside them as the median of the ratios of
repeats taken side by side, without a target: on a shared 2-core machine the load decided
it (a save's fsyncs took 17-540 ms at the same N; at load 6-9 the save's ratio missed 1.5
in a run where the same code met it alone), so it is no check of the code. Retention's
time grows with N on ext4 although its calls do not: its one `rmdir` of each emptied
per-rank folder reads every block that folder grew to (about 0.2-0.3 s for 16,384 entries
here), work of the file system's inside one call, in a thread of rank 0's while training
goes on.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ddp_amp.bench.file_ops import FileOps
from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import target_fields
from ddp_amp.checkpoint.discovery import candidate_dirs, step_dir_name
from ddp_amp.checkpoint.load import read_checkpoint
from ddp_amp.checkpoint.manifest import MANIFEST_NAME
from ddp_amp.checkpoint.meta import Meta
from ddp_amp.checkpoint.rank_files import write_own_files
from ddp_amp.checkpoint.rank_reports import EXCHANGE_BYTES, Reports, encode_report
from ddp_amp.checkpoint.retention import Retention, delete_rank_files
from ddp_amp.checkpoint.rng import capture_rng
from ddp_amp.checkpoint.save import commit_reported, prepare, scratch_folders
from ddp_amp.checkpoint.verify import check_own_files, verdict

RANKS = (64, 4096, 16384)
REPEATS = 3
RESUME_REPEATS = 5  # resumes per save repeat: cheap beside a save, so more of them for a steadier median
KEEP_LAST = 1
WRITERS = 16  # threads writing the emulated ranks' files: one disk absorbs concurrent fsyncs best so
SAMPLE = 8  # emulated ranks whose resume report is computed by their own real check
T = TypeVar("T")


class _Rank0:
    """Rank 0's counted work at one world size: time, file operations, entries read."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.ops = FileOps()

    def run(self, work: Callable[[], T]) -> T:
        """Run `work` as rank 0's, counted and timed."""
        started = time.perf_counter()
        with self.ops:
            result = work()
        self.seconds += time.perf_counter() - started
        return result


def _state() -> tuple[dict[str, Any], Meta]:
    """Rank 0's files of a small replicated model, as the Checkpointer lays them out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    files = {"model.pt": model.state_dict(), "state.pt": {"optimizer": optimizer.state_dict(), "step": 1}}
    return files, Meta(saved_by="ddp_amp", precision="fp32", modules=("model",), per_rank=())


def _save(root: Path, step: int, world: int, pool: ThreadPoolExecutor, retention: Retention) -> dict[str, Any]:
    """One save at `world` ranks: rank 0's share counted, the others' written from `pool`."""
    files, meta = _state()
    target, folders, contents = root / step_dir_name(step), scratch_folders(False), dict[str, Any]()
    rng = capture_rng(torch.device("cpu"))
    rank0 = _Rank0()
    scratch_path, failure = rank0.run(lambda: prepare(target, files, meta, world, contents, folders))
    if scratch_path is None:
        raise RuntimeError(f"the emulated save could not start: {failure}")
    scratch = Path(scratch_path)
    own = rank0.run(lambda: write_own_files(scratch, 0, rng))
    others = list(pool.map(lambda rank: write_own_files(scratch, rank, rng), range(1, world)))
    reported = Reports.of([own, *others])  # what the reports' exchange hands rank 0
    path, failure, retired = rank0.run(lambda: commit_reported(target, scratch, reported, contents, {}, folders,
                                                               KEEP_LAST, retention))
    if path is None:
        raise RuntimeError(f"the emulated save failed: {failure}")
    return {"seconds": rank0.seconds, "ops": rank0.ops.total, "entries": rank0.ops.entries,
            "calls": dict(rank0.ops.calls), "reports": [own, *others], "path": target,
            **_retention_step(retired, world, pool, retention)}


def _retention_step(retired: list[str], world: int, pool: ThreadPoolExecutor, retention: Retention) -> dict[str, Any]:
    """The deletion of what a commit retired: ranks 1..N-1 their own files (from `pool`, timed
    apart), then rank 0 its own and what is left, counted; {} where nothing was retired."""
    if not retired:
        return {}
    retention.wait()  # the commit's own thread: nothing of this step's
    started = time.perf_counter()
    for path in retired:
        list(pool.map(partial(delete_rank_files, Path(path), world_size=world), range(1, world)))
    others_s = time.perf_counter() - started
    rank0 = _Rank0()
    rank0.run(lambda: retention.let_go_own(retired, 0, world, background=False))
    rank0.run(lambda: retention.end(remove_remains=True))
    if any(Path(path).exists() for path in retired):
        raise RuntimeError(f"the emulated retention left {retired}")
    return {"retention_s": rank0.seconds, "retention_ops": rank0.ops.total, "retention_entries": rank0.ops.entries,
            "retention_calls": dict(rank0.ops.calls), "ranks_deletion_s": others_s}


def _resume(root: Path, world: int, reported: list[bytes]) -> dict[str, Any]:
    """Rank 0's share of finding and reading the newest checkpoint under `root` at `world`
    ranks; `reported`: every rank's report, which their exchange combines for rank 0."""
    rank0 = _Rank0()
    newest = rank0.run(lambda: candidate_dirs(root))[0]
    own = rank0.run(lambda: check_own_files(newest, 0, world))
    reports = Reports.of([encode_report(own.fold, own.failure or ""), *reported[1:]])  # the exchange's, as above
    failure = rank0.run(lambda: verdict(newest, own, reports))
    if failure is not None:
        raise RuntimeError(f"the emulated resume found {newest} incomplete: {failure}")
    rank0.run(lambda: read_checkpoint(newest, None, rank=0))
    return {"seconds": rank0.seconds, "ops": rank0.ops.total, "entries": rank0.ops.entries,
            "calls": dict(rank0.ops.calls)}


def _resume_reports(path: Path, world: int, saved: list[bytes]) -> list[bytes]:
    """What ranks 1..N-1 report to rank 0 when they check `path`: for a whole checkpoint on
    as many ranks, each the leaf of its own record (its save report's digest); a sample is
    checked by the real `check_own_files` to show that."""
    for rank in sorted({1, world // 2, world - 1} | set(range(1, min(world, SAMPLE))) - {0}):
        check = check_own_files(path, rank, world)
        if check.failure is not None or encode_report(check.fold) != saved[rank]:
            raise RuntimeError(f"emulated rank {rank}'s check of {path} disagrees with its save: {check.failure}")
    return [encode_report(report[:32]) for report in saved]


def _in_turn(ranks: tuple[int, ...], repeat: int) -> tuple[int, ...]:
    """The world sizes in the order of this repeat: interleaved, so drift in the machine's load
    reaches every size alike, and reversed every other time, as going first or second costs
    differently (measured: 2x on a resume here, in one order)."""
    return ranks if repeat % 2 == 0 else tuple(reversed(ranks))


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(row[key] for row in rows))


def run(ranks: tuple[int, ...] = RANKS, repeats: int = REPEATS, folder: str | None = None) -> dict[str, Any]:
    """Rank 0's time and file operations at save and resume for each of `ranks` emulated ranks."""
    saves: dict[int, list[dict[str, Any]]] = {world: [] for world in ranks}
    resumes: dict[int, list[dict[str, Any]]] = {world: [] for world in ranks}
    with tempfile.TemporaryDirectory(dir=folder) as scratch, ThreadPoolExecutor(WRITERS) as pool:
        roots = {world: Path(scratch) / f"ranks-{world}" / "checkpoints" for world in ranks}
        retention = {world: Retention() for world in ranks}  # rank 0's, one per run
        for step in range(1, KEEP_LAST + repeats + 1):  # the first KEEP_LAST fill the folder: each counted
            for world in _in_turn(ranks, step):  # save lets one go, and its deletion is counted
                saved = _save(roots[world], step, world, pool, retention[world])
                if step > KEEP_LAST:
                    saves[world].append(saved)
        for world in ranks:
            reported = _resume_reports(saves[world][-1]["path"], world, saves[world][-1]["reports"])
            for row in saves[world]:
                row.pop("reports")
            saves[world][-1]["reported"] = reported
        for repeat in range(RESUME_REPEATS * repeats):
            for world in _in_turn(ranks, repeat):
                resumes[world].append(_resume(roots[world], world, saves[world][-1]["reported"]))
        manifest_bytes = {world: (saves[world][-1]["path"] / MANIFEST_NAME).stat().st_size for world in ranks}
    rows = []
    for world in ranks:
        save, resume = saves[world], resumes[world]
        rows.append({"ranks": world, "files": 2 * world + 4, "manifest_bytes": manifest_bytes[world],
                     "exchanged_bytes": EXCHANGE_BYTES,
                     "save_s": _median(save, "seconds"), "save_ops": _median(save, "ops"),
                     "save_entries": _median(save, "entries"), "save_calls": save[-1]["calls"],
                     "retention_s": _median(save, "retention_s"), "retention_ops": _median(save, "retention_ops"),
                     "retention_entries": _median(save, "retention_entries"),
                     "retention_calls": save[-1]["retention_calls"],
                     "ranks_deletion_s": _median(save, "ranks_deletion_s"),
                     "resume_s": _median(resume, "seconds"), "resume_ops": _median(resume, "ops"),
                     "resume_entries": _median(resume, "entries"), "resume_calls": resume[-1]["calls"]})
    paired = {phase: _paired_ratio(runs[ranks[-1]], runs[ranks[0]], key)
              for phase, runs, key in (("save", saves, "seconds"), ("resume", resumes, "seconds"),
                                       ("retention", saves, "retention_s"))}
    return {"rows": rows, "repeats": repeats, "resume_repeats": RESUME_REPEATS * repeats,
            "time_ratios": paired, "target_checks": _checks(rows)}


def _paired_ratio(large: list[dict[str, Any]], small: list[dict[str, Any]], key: str) -> float:
    """The median of the ratios of rank 0's times `key`, repeat by repeat (each pair taken side by side)."""
    return float(statistics.median(a[key] / max(b[key], 1e-9) for a, b in zip(large, small)))


def _checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Largest N against smallest: file operations and entries at most 1x, at save, at
    resume and for retention (counts; time has no target: see the module's docstring)."""
    small, large = rows[0], rows[-1]
    span = f"{large['ranks']:,} / {small['ranks']:,} ranks"
    checks = []
    for phase in ("save", "resume", "retention"):
        for key, what in (("ops", "file operations"), ("entries", "directory entries read")):
            ratio = large[f"{phase}_{key}"] / max(small[f"{phase}_{key}"], 1)
            checks.append({"name": f"rank 0 at {phase}", **target_fields(f"{what}, {span}", ratio, 1.0)})
    return checks


def rank_zero_table(section: dict[str, Any]) -> str:
    """The section as a table: a row per world size, then each target."""
    lines = [[f"{row['ranks']:,}", f"{row['files']:,}", f"{row['manifest_bytes']:,}",
              f"{row['exchanged_bytes']:,}", f"{row['save_s'] * 1e3:.1f}",
              f"{row['save_ops']:.0f}", f"{row['save_entries']:.0f}", f"{row['resume_s'] * 1e3:.1f}",
              f"{row['resume_ops']:.0f}", f"{row['resume_entries']:.0f}", f"{row['retention_s'] * 1e3:.1f}",
              f"{row['retention_ops']:.0f}", f"{row['retention_entries']:.0f}", f"{row['ranks_deletion_s']:.2f}"]
             for row in section["rows"]]
    checks = "\n".join(f"  {check['name']}: {check['figure']} {check['measured']:.2f} (target at most "
                       f"{check['target']:g})" for check in section["target_checks"])
    rows = section["rows"]
    for phase, ratio in section["time_ratios"].items():
        checks += (f"\n  rank 0 at {phase}: time, {rows[-1]['ranks']:,} / {rows[0]['ranks']:,} ranks (median of paired "
                   f"ratios) {ratio:.2f} (no target: the machine's load decides it; the counts above are the check)")
    return (f"resume: rank 0's share at N emulated ranks (medians of {section['repeats']} saves and "
            f"{section['resume_repeats']} resumes)\n"
            + grid(["ranks", "files", "manifest B", "exchanged B", "save ms", "save ops", "save entries", "resume ms",
                    "resume ops", "resume entries", "retention ms", "retention ops", "retention entries",
                    "ranks' deletion s"], lines) + "\n" + checks)
