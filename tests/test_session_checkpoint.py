"""Session checkpoints on the checkpoint package: manifest, RNG, safe types, crashes, 2 ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ddp_amp import DistContext, Session, UsageError
from ddp_amp.checkpoint import verify_checkpoint
from tests.multiproc import REPO_ROOT, kill_when, run_ranks, slow_writes_env


def test_round_trip_keeps_numpy_and_path_values_with_manifest_and_rng(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with Session("fp32", "cpu", environ={}) as session:
        model = session.setup(nn.Linear(3, 2))
        state = {"model": model, "step": np.int64(7), "lr": np.float32(0.5), "data": Path("/data/shard-3"),
                 "order": np.arange(4)}
        session.save(path, state)
        after_save = torch.rand(3)  # what the RNG gives right after the save
        manifest = verify_checkpoint(path)
        assert set(manifest["files"]) == {"model.pt", "state.pt", "rng/rank-00000.pt", "ranks/rank-00000.json",
                                          "meta.json"}
        meta = json.loads((path / "meta.json").read_text())
        assert meta["world_size"] == 1 and meta["torch_version"] == torch.__version__
        torch.rand(5)  # move the stream on; the load must put it back
        loaded = session.load(path, {"model": model})
        assert torch.equal(torch.rand(3), after_save)  # RNG restored to the saved state
    assert type(loaded["step"]) is np.int64 and loaded["step"] == 7
    assert type(loaded["lr"]) is np.float32 and loaded["lr"] == np.float32(0.5)
    assert loaded["data"] == Path("/data/shard-3") and isinstance(loaded["data"], Path)
    assert np.array_equal(loaded["order"], np.arange(4))


def test_state_that_would_not_load_is_refused_and_nothing_is_lost(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with Session("fp32", "cpu", environ={}) as session:
        session.save(path, {"step": 1})
        before = (path / "state.pt").read_bytes()
        with pytest.raises(UsageError, match=r"checkpoint entry=\"state.pt\['fn'\]\""):
            session.save(path, {"step": 2, "fn": lambda x: x})
        with pytest.raises(UsageError, match=r"state.pt\['thing'\]"):
            session.save(path, {"step": 2, "thing": _Custom()})  # loads only by running its code
        assert (path / "state.pt").read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        assert session.load(path, {})["step"] == 1


class _Custom:
    pass


def test_a_checkpoint_saved_again_under_one_name_replaces_its_old_copy_each_time(tmp_path: Path) -> None:
    # Each save retires the copy it replaces; what is left of the last one may still be
    # there when the next save retires its own.
    with Session("fp32", "cpu", environ={}) as session:
        for step in range(4):
            session.save(tmp_path / "best", {"step": step})
        assert session.load(tmp_path / "best", {})["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    script = str(REPO_ROOT / "tests/scripts/session_save_loop.py")
    # Each file written 0.3 s slower (tests/slow_writes), so the kill lands inside the second save.
    proc = subprocess.Popen([sys.executable, script, str(path), "5"], env=slow_writes_env(0.3),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "saved 1"
    kill_when(proc, lambda: any(tmp_path.glob(".tmp-ckpt-*/state.pt")), "the second save")
    assert proc.returncode == -signal.SIGKILL
    with Session("fp32", "cpu", environ={}) as session:
        loaded = session.load(path, {})
        assert loaded["n"] == 1 and torch.equal(loaded["weights"], torch.full((4,), 1.0))
        session.save(path, {"n": 9})  # the next save clears what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_crash_while_replacing_leaves_the_old_copy_found(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with Session("fp32", "cpu", environ={}) as session:
        session.save(path, {"n": 1})
        # A crash between moving the old directory aside and renaming the new one in:
        path.rename(tmp_path / ".tmp-old-ckpt-77")
        assert session.load(path, {})["n"] == 1


def _two_rank_session_checkpoint(ctx: DistContext, directory: str) -> dict[str, object]:
    path = Path(directory) / "ckpt"
    with Session("fp16", "cpu", environ=os.environ) as session:
        torch.manual_seed(0)
        model = session.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(100 + ctx.rank)  # each rank its own stream, as training has
        session.save(path, {"model": model, "optimizer": optimizer, "epoch": np.int64(3)})
        expected = torch.rand(2)
        torch.rand(7)
        loaded = session.load(path, {"model": model, "optimizer": optimizer})
        restored = torch.rand(2)
        errors = {}
        for name, state in (("lambda", {"fn": lambda: 0}), ("missing", None)):
            try:
                if state is None:
                    session.load(path, {"not_saved": model})
                else:
                    session.save(path, state)
            except UsageError as error:
                errors[name] = str(error)
        # A rank-1-only bad entry: rank 0 checks what it writes, so rank 0's view decides;
        # rank 1 must not wait for a save that never came.
        try:
            session.save(Path(directory) / "other", {"fn": (lambda: 0) if ctx.rank == 0 else 1})
        except UsageError as error:
            errors["rank0_only"] = str(error)
        # A per-rank value only rank 1 holds that would not load back: each rank checks its
        # own, and rank 1's refusal is every rank's, before anything is written.
        try:
            session.save(Path(directory) / "per-rank", {"step": 1}, per_rank={"cursor": (lambda: 0) if ctx.rank else 1})
        except UsageError as error:
            errors["rank1_per_rank"] = str(error)
    return {"epoch": int(loaded["epoch"]), "rng_restored": torch.equal(expected, restored),
            "own_stream": expected, "errors": errors}


def test_two_ranks_save_and_load_agree_and_fail_together(tmp_path: Path) -> None:
    results = run_ranks(_two_rank_session_checkpoint, 2, str(tmp_path), timeout=240)
    for result in results:
        assert result["epoch"] == 3 and result["rng_restored"]
        assert set(result["errors"]) == {"lambda", "missing", "rank0_only", "rank1_per_rank"}, result["errors"]
        assert "state.pt['fn']" in result["errors"]["lambda"]
        assert "per_rank['cursor']" in result["errors"]["rank1_per_rank"], result["errors"]
        assert "not_saved" in result["errors"]["missing"]
    assert not torch.equal(results[0]["own_stream"], results[1]["own_stream"])  # each rank its own RNG
    assert not (tmp_path / "other").exists() and not (tmp_path / "per-rank").exists()
