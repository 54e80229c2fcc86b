"""Each rank writes, hashes and checks what it owns; rank 0's share does not grow with the ranks.

Two real gloo ranks of a sharded `Session`, each rank's file-system calls recorded
(`ddp_amp.bench.file_ops`): rank 0 touches no file of rank 1's at save or at resume, no rank
lists the folders every rank writes into or reads back what it wrote (the check of a
checkpoint on resume included; what DCP's load then reads is its plan's), and a damaged file
of rank 1's own (its RNG file, or its files swapped for another save's) is found by the
check: `--resume auto` falls back past it, a named checkpoint is refused on every rank.
Then rank 0's real code at emulated world sizes (`ddp_amp.bench.rank_zero`): the same
file operations at 4 and at 48 ranks.
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

FIRST, SECOND = "step-00000001", "step-00000002"
SHARED_FOLDERS = ("sharded", "rng", "ranks")  # every rank writes into them: listing one is O(N)


def _refusal(session: Session, path: Path, state: dict[str, Any]) -> str:
    try:
        session.load(path, state)
    except UsageError as error:
        return str(error)
    return ""


def _two_ranks(ctx: DistContext, directory: str) -> dict[str, Any]:
    root = Path(directory)
    saving: list[tuple[str, str, str]] = []  # the first save's calls
    with Session("fp32", "cpu", backend="gloo", environ=os.environ, shard=ShardOptions()) as session:
        torch.manual_seed(0)
        model = session.setup(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = {"model": model, "optimizer": optimizer}
        for step in (FIRST, SECOND):  # a step apart: other weights, another RNG state
            session.backward(model(torch.randn(4, 8)).square().mean())
            session.step(optimizer)
            with FileOps(paths=True) as ops:
                session.save(root / step, state)
            saving = saving or ops.seen
        if ctx.rank == 1:  # rank 1's own RNG file of the newest checkpoint, one byte flipped
            damaged = root / SECOND / "rng" / "rank-00001.pt"
            data = bytearray(damaged.read_bytes())
            data[len(data) // 2] ^= 0xFF
            damaged.write_bytes(bytes(data))
        session.all_reduce(torch.zeros(1))  # the damage is done before any rank looks
        warnings: list[str] = []
        with FileOps(paths=True) as resuming:  # the check; the read after it is DCP's plan, any rank's part
            found = session.checkpointer.choose("auto", root, warnings.append)
        session.load(found, state)
        damaged_refused = _refusal(session, root / SECOND, state)
        if ctx.rank == 1:  # all of rank 1's files of the older save, each whole and matching its record
            for name in ("rng/rank-00001.pt", "sharded/__1_0.distcp", "ranks/rank-00001.json"):
                shutil.copyfile(root / FIRST / name, root / SECOND / name)
        session.all_reduce(torch.zeros(1))
        swapped_refused = _refusal(session, root / SECOND, state)
    return {"saving": saving, "resuming": resuming.seen, "found": found, "warnings": warnings,
            "damaged": damaged_refused, "swapped": swapped_refused}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_two_ranks, 2, str(tmp_path_factory.mktemp("own")), timeout=240)


def test_each_rank_writes_its_own_files_and_rank_zero_touches_none_of_the_others(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_ranks):
        written = {path for kind, path, mode in result["saving"] if kind == "open" and "w" in mode}
        for own in (f"rng/rank-0000{rank}.pt", f"ranks/rank-0000{rank}.json", f"sharded/__{rank}_0.distcp"):
            assert any(path.endswith(own) for path in written), (rank, own, sorted(written))
        for phase in ("saving", "resuming"):
            listed = [path for kind, path, _ in result[phase] if kind == "list"]
            assert not [path for path in listed if Path(path).name in SHARED_FOLDERS], (rank, phase, listed)
        # A rank's files are hashed as they are written: none is opened again to be read.
        read_back = [path for kind, path, mode in result["saving"]
                     if kind == "open" and "r" in mode and "/.tmp-" in path]
        assert not read_back, (rank, read_back)
    rank1 = [path for phase in ("saving", "resuming") for _, path, _ in two_ranks[0][phase]
             if "rank-00001" in path or "__1_" in path]
    assert not rank1, rank1  # rank 0 neither wrote, stat-ed nor read any of rank 1's files


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
    for phase in ("save", "resume"):
        assert small[f"{phase}_calls"] == large[f"{phase}_calls"], phase
        assert small[f"{phase}_entries"] == large[f"{phase}_entries"], phase
    assert abs(small["manifest_bytes"] - large["manifest_bytes"]) <= 2  # the count's digits, no entry per rank
    assert {check["meets_target"] for check in section["target_checks"] if "time" not in check["figure"]} == {True}
