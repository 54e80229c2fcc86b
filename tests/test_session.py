"""Session: lifecycle, wrapping, step and checkpoints, in one process and on 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp import AutocastModule, DistContext, Session, UsageError
from ddp_amp.errors import TrainingHalted
from tests.multiproc import REPO_ROOT, cli_env, run_ranks


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def one_step(session: Session, model: nn.Module, optimizer: torch.optim.Optimizer, **step_options: float) -> None:
    with session.autocast():
        loss = model(torch.randn(6, 4)).float().pow(2).mean()
    session.backward(loss)
    session.step(optimizer, **step_options)
    optimizer.zero_grad(set_to_none=True)


def test_single_process_needs_no_group_and_wraps_in_autocast_only() -> None:
    with Session("fp16", "cpu", environ={}) as session:
        assert session.world_size == 1 and session.env.launcher == "single"
        model = session.setup(tiny())
        assert isinstance(model, AutocastModule) and not dist.is_initialized()
        assert session.local_module(model) is model
        assert model(torch.randn(2, 4)).dtype == torch.float16
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with session.no_sync(model):  # a no-op without DDP
            one_step(session, model, optimizer, clip_grad_norm=1.0)
        assert session.scaler.is_enabled()


def test_fp32_session_passes_through_without_scaling() -> None:
    with Session("fp32", "cpu", environ={}) as session:
        model = session.setup(tiny())
        assert not session.scaler.is_enabled() and session.scale(torch.tensor(3.0)).item() == 3.0
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        session.backward(model(torch.randn(6, 4)).pow(2).mean())
        result = session.step(optimizer, clip_grad_norm=1e-3)
        assert result.skipped is not None and int(result.skipped) == 0
        assert result.grad_norm is not None and result.grad_norm.item() > 1e-3
        norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        assert norm == pytest.approx(1e-3, rel=1e-3)
        assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_misuse_is_a_usage_error() -> None:
    session = Session("fp32", "cpu", environ={})
    with pytest.raises(UsageError, match="not started"):
        session.setup(tiny())
    with session:
        with pytest.raises(UsageError, match="already started"):
            session.__enter__()
        with pytest.raises(UsageError, match="plain user module"):
            session.setup(session.setup(tiny()))
        optimizer = torch.optim.SGD(tiny().parameters(), lr=0.1)
        with pytest.raises(UsageError, match="at least one optimizer"):
            session.step()
        with pytest.raises(UsageError, match="clip_grad_norm"):
            session.step(optimizer, clip_grad_norm=0.0)
        with pytest.raises(UsageError, match="reserved"):
            session.save("unused.pt", {"scaler": 1})
    with pytest.raises(UsageError, match="precision"):
        Session("fp8", "cpu", environ={}).__enter__()


def test_save_load_round_trip_restores_model_optimizer_scaler(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with Session("fp16", "cpu", scaler_options={"init_scale": 512.0, "growth_interval": 1},
                 environ={}) as session:
        model = session.setup(tiny())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(2):
            one_step(session, model, optimizer)
        session.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        saved_scale = session.scaler.get_scale()
        saved_weights = {k: v.clone() for k, v in session.unwrap(model).state_dict().items()}
    assert saved_scale == 2048.0
    # The one layout: each module in a file of its own, unwrapped names; the rest in state.pt.
    weights = torch.load(path / "model.pt", weights_only=True)
    assert set(weights) == set(saved_weights) and not any(key.startswith("module.") for key in weights)
    assert set(torch.load(path / "state.pt", weights_only=True)) == {"optimizer", "step", "scaler"}

    with Session("fp16", "cpu", environ={}) as session:
        torch.manual_seed(1)
        restored = session.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=0.01)
        payload = session.load(path, {"model": restored, "optimizer": restored_optimizer})
        assert payload["step"] == 2
        assert session.scaler.get_scale() == saved_scale
        for key, value in session.unwrap(restored).state_dict().items():
            assert torch.equal(value, saved_weights[key])
        assert restored_optimizer.state_dict()["state"][0]["step"] == 2
        with pytest.raises(UsageError, match="checkpoint key"):
            session.load(path, {"missing": restored})


def test_failed_save_keeps_previous_file_and_leaves_no_scratch(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with Session("fp32", "cpu", environ={}) as session:
        session.save(path, {"step": 1})
        before = (path / "state.pt").read_bytes()
        (tmp_path / "blocked").mkdir()
        (tmp_path / "blocked" / "entry").write_text("x")  # not a checkpoint: never replaced
        with pytest.raises(UsageError, match="writable"):
            session.save(tmp_path / "blocked", {"step": 2})
        assert (path / "state.pt").read_bytes() == before
        assert (tmp_path / "blocked" / "entry").read_text() == "x"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "ckpt"]
        with pytest.raises(UsageError, match="existing checkpoint"):
            session.load(tmp_path / "nope.pt", {})
        (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
        with pytest.raises(UsageError, match="could not be read"):
            session.load(tmp_path / "garbage.pt", {})


def _session_in_callers_group(ctx: DistContext) -> dict[str, object]:
    """On 2 ranks whose group the caller made: the session must leave it (and the model) be."""
    with Session("fp16", "cpu", environ=os.environ) as session:
        model = session.setup(tiny(), find_unused_parameters=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        one_step(session, model, optimizer, clip_grad_norm=0.5)
    group_kept = dist.is_initialized()
    model(torch.randn(6, 4)).float().pow(2).mean().backward()  # DDP still works: an all-reduce
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"was_ddp": isinstance(model, DDP), "group_kept": group_kept, "grads": grads,
            "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


def test_session_leaves_a_callers_group_alone() -> None:
    results = run_ranks(_session_in_callers_group, 2)
    for result in results:
        assert result["was_ddp"] and result["group_kept"]
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert torch.equal(results[0]["grads"], results[1]["grads"])


def test_close_releases_a_live_ddp_model_and_exits_cleanly(tmp_path: Path) -> None:
    facts = tmp_path / "facts.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(REPO_ROOT / "tests/scripts/session_live_model.py"),
                             str(facts)], capture_output=True, text=True, timeout=240, env=cli_env())
    assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr[-4000:]
    observed = json.loads(facts.read_text())
    assert observed == {"group_gone": True, "reducer_released": True, "model_alive": True}


def _two_backwards_and_drift(ctx: DistContext) -> dict[str, object]:
    with Session("fp32", "cpu", environ=os.environ) as session:
        torch.manual_seed(0)
        model = session.setup(tiny())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(ctx.rank)
        out = model(torch.randn(6, 4))
        loss0, loss1 = out.pow(2).mean(), out.abs().mean()
        refused = ""
        try:
            session.backward(loss0, retain_graph=True)  # the AMP recipe's two-loss pattern
        except UsageError as error:
            refused = str(error)
        session.backward(loss0 + loss1)  # the fix the error names: one backward of the sum
        session.step(optimizer)
        session.check_sync(model, step=1)  # the replicas agree
        if ctx.rank == 1:
            with torch.no_grad():
                session.unwrap(model)[0].bias[0] += 1.0
        drift = ""
        try:
            session.check_sync(model, step=1)
        except TrainingHalted as error:
            drift = str(error)
    return {"refused": refused, "drift": drift,
            "params": torch.cat([p.detach().flatten() for p in session.unwrap(model).parameters()])}


def test_a_second_backward_through_ddp_is_refused_and_drift_is_caught() -> None:
    rank0, rank1 = run_ranks(_two_backwards_and_drift, 2)
    for result in (rank0, rank1):
        assert "retain_graph=True" in result["refused"] and "sum the losses" in result["refused"]
        assert "rank 1 differs from rank 0 in parameters 0.bias" in result["drift"]
    # with the fix, both ranks stepped on the same reduced gradients (before rank 1's drift)
    differ = (rank0["params"] - rank1["params"]).abs()
    assert differ.max().item() == 1.0 and (differ > 0).sum().item() == 1


def test_an_exception_leaving_one_ranks_session_ends_the_other_within_seconds() -> None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO_ROOT / "tests/scripts/session_one_rank_raises.py")], capture_output=True,
                            text=True, timeout=120, env=cli_env(DDP_AMP_UNUSED="1"))
    assert result.returncode != 0 and time.monotonic() - started < 30, result.stderr[-3000:]
    assert result.stderr.count("RuntimeError: planted failure in rank 1's own loop") == 1  # printed once
