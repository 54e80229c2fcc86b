"""Checkpoints written by earlier code still resume: the CLI's `--resume` and `Session.load`,
from copies of tests/fixtures/checkpoint_v0 (every rank's RNG in one rng.pt) and, by
`Session.load`, the export and discovery, of tests/fixtures/checkpoint_v1 (manifest format
1, listing every rank's files); a per-rank entry of tests/fixtures/checkpoint_v2 (every
rank's values in one file of rank 0's) is refused on another number of ranks, as each rank's
own file is (tests/test_checkpoint_ownership.py reads it on as many ranks); see their READMEs
for how they were made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ddp_amp import Session, UsageError
from ddp_amp.checkpoint import newest_complete, verify_checkpoint
from ddp_amp.checkpoint.meta import Meta, read_meta
from ddp_amp.export import main as export_main
from ddp_amp.tasks.mlp import make_model
from ddp_amp.torch_api import SHARDING
from tests.multiproc import run_train
from tests.torch_features import needs_sharding

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoint_v0"
FORMAT_1 = Path(__file__).parent / "fixtures" / "checkpoint_v1"
PER_RANK_FILES = Path(__file__).parent / "fixtures" / "checkpoint_v2" / "carried" / "checkpoints" / "step-00000004"
STEP = "step-00000003"
TINY = ["--task", "mlp", "--device", "cpu", "--seed", "0", "--batch-size", "8", "--eval-every", "0",
        "--task-opt", "in_size=8", "--task-opt", "hidden=16", "--task-opt", "out_size=4", "--task-opt", "layers=2",
        "--task-opt", "samples=256", "--ckpt-every", "3"]


def _copy(tmp_path: Path, name: str, fixtures: Path = FIXTURES) -> Path:
    """A copy of fixture run `name`'s checkpoint, so nothing is written into the fixture."""
    shutil.copytree(fixtures / name, tmp_path / "fixture" / name)
    return tmp_path / "fixture" / name / "checkpoints" / STEP


def _saved_weights(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as the fixture holds them, read with torch's own loaders."""
    if (checkpoint / "model.pt").exists():
        return torch.load(checkpoint / "model.pt", weights_only=True)
    dcp_to_torch_save(checkpoint / "sharded", tmp_path / "full.pt")  # the DCP shards, merged
    return torch.load(tmp_path / "full.pt", weights_only=True)["model"]


def _assert_same(weights: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert sorted(weights) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("fixtures", [FIXTURES, FORMAT_1], ids=["v0", "v1"])
@pytest.mark.parametrize("name", ["single", pytest.param("shard", marks=needs_sharding)])
def test_session_load_restores_step_and_weights(tmp_path: Path, name: str, fixtures: Path) -> None:
    checkpoint = _copy(tmp_path, name, fixtures)
    saved = _saved_weights(checkpoint, tmp_path)
    with Session("fp32", "cpu", environ={}) as session:
        assert session.latest(checkpoint.parent) == checkpoint
        model = session.setup(make_model(8, 16, 4, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        values = session.load(checkpoint, {"model": model, "optimizer": optimizer})
        assert values["step"] == 3 and values["samples_seen"] == 24
        _assert_same(Session.unwrap(model).state_dict(), saved)
        assert all(state["step"] == 3 for state in optimizer.state_dict()["state"].values())


@pytest.mark.parametrize("name", ["single", pytest.param("shard", marks=needs_sharding)])
def test_cli_resume_restores_step_and_weights(tmp_path: Path, name: str) -> None:
    checkpoint = _copy(tmp_path, name)
    saved = _saved_weights(checkpoint, tmp_path)
    run_dir = tmp_path / "resumed"
    # Resumed at the step it ends on: no step is taken, and the final save writes the
    # restored state into the new run's directory, replicated, one process.
    result = run_train([*TINY, "--max-steps", "3", "--resume", str(checkpoint), "--run-dir", str(run_dir)])
    assert result.returncode == 0, result.stderr
    assert f"resume from {checkpoint} at step 3" in result.stderr + result.stdout
    written = run_dir / "checkpoints" / STEP
    _assert_same(torch.load(written / "model.pt", weights_only=True), saved)
    state = torch.load(written / "state.pt", weights_only=True)
    assert state["step"] == 3 and state["samples_seen"] == 24


@pytest.mark.parametrize("name", ["single", "shard"])
def test_meta_reads_every_field_and_writes_the_same_json(name: str) -> None:
    checkpoint = FIXTURES / name / "checkpoints" / STEP
    meta = read_meta(checkpoint)  # reads only
    assert (meta.saved_by, meta.step, meta.world_size, meta.optimizer_class) == \
        ("ddp_amp.Trainer", 3, 1 if name == "single" else 2, "AdamW")
    assert meta.sharded == (("model", "optimizer") if name == "shard" else ())
    assert meta.config is not None and meta.config["task"] == "mlp" and meta.extra == {}
    assert json.loads(meta.encode()) == json.loads((checkpoint / "meta.json").read_text())


@needs_sharding
def test_a_format_1_checkpoint_verifies_exports_and_is_skipped_when_a_rank_file_is_damaged(tmp_path: Path) -> None:
    checkpoint = _copy(tmp_path, "shard", FORMAT_1)
    listed = set(verify_checkpoint(checkpoint)["files"])  # every file, as that manifest lists them
    assert {"rng/rank-00001.pt", "sharded/__1_0.distcp", "sharded/.metadata"} <= listed
    load_file = pytest.importorskip("safetensors.torch").load_file
    assert export_main([str(checkpoint), "--to", str(tmp_path / "model.safetensors")]) == 0
    _assert_same(load_file(tmp_path / "model.safetensors"), _saved_weights(checkpoint, tmp_path))
    damaged = checkpoint / "rng" / "rank-00001.pt"
    damaged.write_bytes(damaged.read_bytes()[::-1])  # same size: only the hash can tell
    warnings: list[str] = []
    assert newest_complete(checkpoint.parent, warnings.append) is None
    assert "rng/rank-00001.pt" in warnings[0] and "sha256 differs" in warnings[0], warnings


@pytest.mark.skipif(SHARDING.available(), reason=f"this torch ({torch.__version__}) reads sharded checkpoints")
def test_a_sharded_checkpoint_is_refused_in_one_line_where_torch_cannot_shard(tmp_path: Path) -> None:
    checkpoint = _copy(tmp_path, "shard", FIXTURES)
    result = run_train([*TINY, "--max-steps", "3", "--resume", str(checkpoint), "--run-dir", str(tmp_path / "r")])
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "checkpoint=" in line and "torch >= 2.7 for sharding" in line and "without --shard" in line


def test_meta_keeps_a_callers_own_keys_and_reads_an_older_record() -> None:
    meta = Meta.from_dict({"step": "7", "note": "mine"})
    assert meta.step == 7 and meta.extra == {"note": "mine"} and meta.to_dict() == {"step": 7, "note": "mine"}
    assert meta.modules is None and meta.per_rank is None  # before meta.json listed them
    assert meta.merged({"world_size": 2}).to_dict() == {"step": 7, "note": "mine", "world_size": 2}


def test_a_per_rank_entry_of_the_format_before_loads_only_on_as_many_ranks(tmp_path: Path) -> None:
    checkpoint = shutil.copytree(PER_RANK_FILES, tmp_path / PER_RANK_FILES.name)
    with Session("fp32", "cpu", environ={}) as session:
        saved, _ = session.read(checkpoint)
        assert saved.per_rank_keys == ("task_state",) and saved.per_rank_ranks == 2
        own = torch.load(checkpoint / "task_state.pt", weights_only=True)["ranks"][0]
        assert torch.equal(saved.per_rank["task_state"]["value"], own["value"])  # rank 0's, read from all of them
        with pytest.raises(UsageError, match=r"a per-rank entry saved by 1 rank\(s\).*it was saved by 2"):
            session.load(checkpoint, {"task_state": object()})
