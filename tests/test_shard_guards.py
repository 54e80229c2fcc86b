"""The watchdogs under --shard, where every parameter is this rank's shard of it (a DTensor):
the finite check before a checkpoint reads every rank's shards, the rank-consistency check
compares what is replicated (the step, the scaler) and not the shards, which differ by
design, and overflow forensics names the parameters whose reduced gradient shards are
non-finite. Real gloo ranks; the CLI run is real torchrun."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_amp import DistContext, Session
from ddp_amp.distributed import local_part
from ddp_amp.parallel import ShardOptions
from ddp_amp.errors import TrainingHalted
from ddp_amp.guards.finite import FiniteStateGuard
from ddp_amp.guards.rank_sync import check_rank_sync
from tests.multiproc import run_ranks, run_train
from tests.torch_features import needs_sharding

pytestmark = needs_sharding


def _checks_on_shards(ctx: DistContext) -> dict[str, Any]:
    """Collective: the finite and rank-sync checks on a sharded model, then with a NaN in
    rank 1's shard of one weight."""
    with Session("fp32", "cpu", backend="gloo", environ=os.environ, shard=ShardOptions()) as session:
        torch.manual_seed(0)
        model = session.unwrap(session.setup(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))))
        named = list(model.named_parameters())
        guard = FiniteStateGuard(torch.device("cpu"), track_losses=False)
        outcome: dict[str, Any] = {"shards_differ": None, "sync": "ok", "finite": "ok"}
        gathered = [torch.empty_like(local_part(named[0][1])) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(gathered, local_part(named[0][1]).detach().contiguous())
        outcome["shards_differ"] = not torch.equal(gathered[0], gathered[1])
        check_rank_sync(named, session.scaler, step=3)  # the shards differ; nothing else does
        guard.check([p for _, p in named], step=3, resume_from="resume from nowhere")
        if ctx.rank == 1:
            with torch.no_grad():
                local_part(named[0][1])[0, 0] = float("nan")
        try:
            guard.check([p for _, p in named], step=4, resume_from="resume from nowhere")
        except TrainingHalted as error:
            outcome["finite"] = str(error)
    return outcome


def test_the_finite_and_rank_sync_checks_read_each_ranks_shards() -> None:
    for outcome in run_ranks(_checks_on_shards, 2, timeout=120):
        assert outcome["shards_differ"] is True
        assert outcome["sync"] == "ok"
        assert "not checkpointing step 4: the weights of rank(s) [1] are non-finite" in outcome["finite"]


def test_fp16_overflow_forensics_names_the_parameters_of_non_finite_gradient_shards(tmp_path: Path) -> None:
    result = run_train(["--device", "cpu", "--precision", "fp16", "--task", "tests.plugins.nonfinite_task:make_task",
                        "--task-opt", "poison=rank_loss", "--task-opt", "bad_rank=1", "--task-opt", "from_step=3",
                        "--shard", "--max-consecutive-skips", "5", "--max-steps", "60", "--batch-size", "16",
                        "--log-every", "50", "--run-dir", str(tmp_path)], nproc=2)
    assert result.returncode != 0
    assert result.stderr.count("ddp_amp: stopped: fp16 loss scaling failed at step 8: 6 consecutive "
                               "optimizer steps were skipped") == 1, result.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    overflows = [e for e in events if e.get("event") == "overflow"]
    # Rank 1's NaN loss makes NaN gradients on rank 1; the reduce-scatter spreads them into
    # every rank's shards, which the scan at each skipped check step (4, 6, 8) names.
    assert overflows and all(e["sharded"] and e["checked"] and e["ranks"] == [0, 1] for e in overflows), overflows
    named = {name for e in overflows for names in e["params"].values() for name in names}
    assert named and named <= {f"{layer}.{kind}" for layer in (0, 2) for kind in ("weight", "bias")}, named
    assert sum(e["skipped"] for e in overflows) == 6
    assert "(sharded: after the reduction over ranks" in result.stdout + result.stderr
    assert not list(tmp_path.glob("checkpoints/step-*"))


def test_a_nan_in_one_ranks_loss_under_shard_is_never_committed(tmp_path: Path) -> None:
    result = run_train(["--task", "tests.plugins.nonfinite_task:make_task", "--task-opt", "poison=rank_loss",
                        "--task-opt", "bad_rank=1", "--task-opt", "from_step=12", "--device", "cpu", "--shard",
                        "--batch-size", "16", "--max-steps", "60", "--ckpt-every", "5", "--keep-last", "3",
                        "--log-every", "50", "--precision", "fp32", "--run-dir", str(tmp_path)], nproc=2)
    assert result.returncode == 1, result.stderr[-3000:]
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000005", "step-00000010"], kept
    assert "not checkpointing step 15: the loss first went non-finite at step 12" in result.stderr
