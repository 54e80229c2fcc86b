"""Each rank writes, hashes, checks, reads and deletes what it owns; rank 0's share does not grow with the ranks.

Two real gloo ranks of a sharded `Session` with a per-rank entry, each rank's file-system
calls recorded (`ddp_amp.bench.file_ops`): rank 0 touches no file of rank 1's at save or at
resume (its per-rank values included: each rank reads back only its own), no rank lists the
folders every rank writes into or reads back what it wrote (the check of a checkpoint on
resume included; what DCP's load then reads is its plan's), and a damaged file of rank 1's
own (its RNG file, or its files swapped for another save's) is found by the check: `--resume
auto` falls back past it, a named checkpoint is refused on every rank. Retention: each rank
deletes its own files of the checkpoints let go, rank 0 none of rank 1's, every thread of
its process counted. A checkpoint of the format before (rank 0's `task_state.pt` of every
rank's values, tests/fixtures/checkpoint_v2) still gives each rank its own value. Then rank
0's real code at emulated world sizes (`ddp_amp.bench.rank_zero`): the same file operations
at 4 and at 48 ranks, at save, at resume and for retention's deletion.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddp_amp import DistContext, Session, UsageError
from ddp_amp.bench import rank_zero
from ddp_amp.bench.file_ops import FileOps
from ddp_amp.parallel import ShardOptions
from tests.multiproc import run_ranks
from tests.torch_features import needs_sharding

FIRST, SECOND, THIRD, FOURTH = (f"step-0000000{step}" for step in (1, 2, 3, 4))
SHARED_FOLDERS = ("sharded", "rng", "ranks", "per_rank")  # every rank writes into them: listing one is O(N)
LEGACY = Path(__file__).parent / "fixtures" / "checkpoint_v2" / "carried" / "checkpoints" / "step-00000004"


def _refusal(session: Session, path: Path, state: dict[str, Any]) -> str:
    try:
        session.load(path, state)
    except UsageError as error:
        return str(error)
    return ""


def _cursor(ctx: DistContext, step: str) -> dict[str, Any]:
    """This rank's per-rank value at `step`: another on each rank and at each step."""
    return {"rank": ctx.rank, "step": step, "position": torch.tensor([ctx.rank, int(step[-1])])}


def _save(ctx: DistContext, session: Session, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path,
          keep_last: int = 0) -> None:
    """A step, then a save at `path` with this rank's per-rank value (another model and RNG state each time)."""
    session.backward(model(torch.randn(4, 8)).square().mean())
    session.step(optimizer)
    session.save(path, {"model": model, "optimizer": optimizer}, per_rank={"cursor": _cursor(ctx, path.name)},
                 keep_last=keep_last)


def _two_ranks(ctx: DistContext, directory: str, legacy: str) -> dict[str, Any]:
    root = Path(directory) / "checkpoints"
    found: dict[str, Any] = {}
    retiring = FileOps(paths=True, all_threads=True)  # every thread's: the deletions run in threads of each rank
    try:
        with Session("fp32", "cpu", backend="gloo", environ=os.environ, shard=ShardOptions()) as session:
            torch.manual_seed(0)
            model = session.setup(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            state = {"model": model, "optimizer": optimizer}
            with FileOps(paths=True) as saving:
                _save(ctx, session, model, optimizer, root / FIRST)
            _save(ctx, session, model, optimizer, root / SECOND)
            found.update(_damaged_and_swapped(ctx, session, root, state))
            with retiring:  # the older two let go at THIRD, what is left of them removed at FOURTH
                _save(ctx, session, model, optimizer, root / THIRD, keep_last=1)
                _save(ctx, session, model, optimizer, root / FOURTH, keep_last=2)
                session.checkpointer.join_locally()  # this rank's part ended (what a session's end does)
            saved, _ = session.read(legacy)  # the format before: every rank's values in one file of rank 0's
            found["legacy"] = (saved.per_rank["task_state"]["value"], saved.per_rank_ranks)
    finally:
        retiring.__exit__(None, None, None)
    return {**found, "saving": saving.seen, "retiring": retiring.seen,
            "left": sorted(path.name for path in root.iterdir())}


def _damaged_and_swapped(ctx: DistContext, session: Session, root: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Resume past a damaged file of rank 1's (recorded), then refuse it, and rank 1's files swapped for older ones."""
    if ctx.rank == 1:  # rank 1's own RNG file of the newest checkpoint, one byte flipped
        damaged = root / SECOND / "rng" / "rank-00001.pt"
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    session.all_reduce(torch.zeros(1))  # the damage is done before any rank looks
    warnings: list[str] = []
    with FileOps(paths=True) as resuming:  # the check; the read after it is DCP's plan, any rank's part
        found = session.checkpointer.choose("auto", root, warnings.append)
    with FileOps(paths=True) as reading:  # what it reads of the ranks' own files: its RNG and per-rank values
        values = session.load(found, {**state, "cursor": object()})
    damaged_refused = _refusal(session, root / SECOND, state)
    if ctx.rank == 1:  # all of rank 1's files of the older save, each whole and matching its record
        for name in ("rng/rank-00001.pt", "per_rank/rank-00001.pt", "sharded/__1_0.distcp", "ranks/rank-00001.json"):
            shutil.copyfile(root / FIRST / name, root / SECOND / name)
    session.all_reduce(torch.zeros(1))
    swapped_refused = _refusal(session, root / SECOND, state)
    return {"resuming": resuming.seen, "reading": [seen for seen in reading.seen if "sharded" not in seen[1]],
            "found": found, "cursor": values["cursor"], "warnings": warnings, "damaged": damaged_refused,
            "swapped": swapped_refused}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("own")
    legacy = shutil.copytree(LEGACY, folder / "legacy" / LEGACY.name)  # never read from the fixture itself
    return run_ranks(_two_ranks, 2, str(folder), str(legacy), timeout=240)


@needs_sharding
def test_each_rank_writes_and_reads_its_own_files_and_rank_zero_touches_none_of_the_others(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_ranks):
        written = {path for kind, path, mode in result["saving"] if kind == "open" and "w" in mode}
        for own in (f"rng/rank-0000{rank}.pt", f"per_rank/rank-0000{rank}.pt", f"ranks/rank-0000{rank}.json",
                    f"sharded/__{rank}_0.distcp"):
            assert any(path.endswith(own) for path in written), (rank, own, sorted(written))
        for phase in ("saving", "resuming", "reading"):
            listed = [path for kind, path, _ in result[phase] if kind == "list"]
            assert not [path for path in listed if Path(path).name in SHARED_FOLDERS], (rank, phase, listed)
        # A rank's files are hashed as they are written: none is opened again to be read.
        read_back = [path for kind, path, mode in result["saving"]
                     if kind == "open" and "r" in mode and "/.tmp-" in path]
        assert not read_back, (rank, read_back)
        read = [path for kind, path, mode in result["reading"] if kind == "open"]
        assert any(path.endswith(f"{FIRST}/per_rank/rank-0000{rank}.pt") for path in read), (rank, read)
        cursor = result["cursor"]  # its own value back, saved by it alone
        assert (cursor["rank"], cursor["step"], cursor["position"].tolist()) == (rank, FIRST, [rank, 1])
    rank1 = [path for phase in ("saving", "resuming", "reading") for _, path, _ in two_ranks[0][phase]
             if "rank-00001" in path or "__1_" in path]
    assert not rank1, rank1  # rank 0 neither wrote, stat-ed nor read any of rank 1's files


@needs_sharding
def test_each_rank_deletes_its_own_files_of_the_checkpoints_retention_lets_go(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_ranks):
        deleted = [path for kind, path, _ in result["retiring"] if kind == "remove" and "/.tmp-retired-" in path]
        for step in (FIRST, SECOND):
            for own in (f"rng/rank-0000{rank}.pt", f"per_rank/rank-0000{rank}.pt", f"ranks/rank-0000{rank}.json",
                        f"sharded/__{rank}_0.distcp"):
                assert any(f"retired-{step}-" in path and path.endswith(own) for path in deleted), (rank, own, deleted)
    rank1 = [(kind, path) for kind, path, _ in two_ranks[0]["retiring"] if "rank-00001" in path or "__1_" in path]
    assert not rank1, rank1  # rank 0 removed what was left once rank 1 had deleted its own
    assert two_ranks[0]["left"] == [THIRD, FOURTH]  # nothing of the two let go, nothing retired, is left


@needs_sharding
def test_a_checkpoint_of_the_format_before_gives_each_rank_its_own_value(two_ranks: list[dict[str, Any]]) -> None:
    every = torch.load(LEGACY / "task_state.pt", weights_only=True)["ranks"]
    for rank, result in enumerate(two_ranks):
        value, ranks = result["legacy"]
        assert ranks == 2 and torch.equal(value, every[rank]["value"]), rank
    assert not torch.equal(every[0]["value"], every[1]["value"])


@needs_sharding
def test_a_damaged_file_of_one_rank_falls_back_and_is_refused_by_name(two_ranks: list[dict[str, Any]],
                                                                      tmp_path: Path) -> None:
    for result in two_ranks:
        assert Path(result["found"]).name == FIRST  # auto: past the damaged newest one, on every rank
        assert "sha256 differs" in result["damaged"] and "rng/rank-00001.pt" in result["damaged"], result["damaged"]
        assert "digest" in result["swapped"], result["swapped"]  # whole files of another save: the digest tells
    (warning,) = two_ranks[0]["warnings"]
    assert warning.startswith("skipping incomplete checkpoint") and SECOND in warning and "rank 1:" in warning
    assert two_ranks[1]["warnings"] == []  # told once, by rank 0


def test_rank_zero_file_operations_are_the_same_at_4_and_48_emulated_ranks() -> None:
    section = rank_zero.run((4, 48), repeats=1)
    small, large = section["rows"]
    for phase in ("save", "resume", "retention"):
        assert small[f"{phase}_calls"] == large[f"{phase}_calls"], phase
        assert small[f"{phase}_entries"] == large[f"{phase}_entries"], phase
    assert abs(small["manifest_bytes"] - large["manifest_bytes"]) <= 2  # the count's digits, no entry per rank
    assert {check["meets_target"] for check in section["target_checks"] if "time" not in check["figure"]} == {True}
