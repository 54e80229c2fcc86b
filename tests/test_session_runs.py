"""A loop written on Session keeps runs the Trainer's tools read: one checkpoint layout, so
`python -m ddp_amp.export` and `--resume` take a Session run; per-rank entries, retention and
background saves work for it as for the Trainer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddp_amp import DistContext, Session, TrainConfig, UsageError
from ddp_amp.checkpoint import step_dir_name
from ddp_amp.errors import CheckpointError
from ddp_amp.export import main as export_main
from ddp_amp.tasks import load_task
from ddp_amp.train import main as train_main
from ddp_amp.trainer import seed_everything
from tests.multiproc import run_ranks

MLP = ("--task", "mlp", "--task-opt", "hidden=16", "--task-opt", "samples=256", "--device", "cpu",
       "--precision", "fp32", "--batch-size", "16", "--eval-every", "0")


def _mlp_model() -> nn.Module:
    config = TrainConfig(task="mlp", task_opt=("hidden=16", "samples=256"))
    seed_everything(config.seed)
    return load_task("mlp", config).model


def test_a_session_run_exports_and_resumes_under_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "session-run"
    with Session("fp32", "cpu", environ={}) as session:
        model = session.setup(_mlp_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        plain = session.unwrap(model)
        for step in range(1, 7):
            inputs = torch.randn(8, plain[0].in_features)
            with session.autocast():
                loss = model(inputs).square().mean()
            session.backward(loss)
            session.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            if step % 2 == 0:
                session.save(root / step_dir_name(step), {"model": model, "optimizer": optimizer, "step": step},
                             keep_last=2)
        assert session.latest(root) == root / "step-00000006"
        final = {name: value.clone() for name, value in plain.state_dict().items()}
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]  # retention

    # export: the newest checkpoint of the folder, loadable strictly into the plain module
    out = tmp_path / "model.safetensors"
    assert export_main([str(root), "--to", str(out)]) == 0
    fresh = _mlp_model()
    fresh.load_state_dict(load_file(out), strict=True)
    assert all(torch.equal(fresh.state_dict()[name], final[name]) for name in final)

    # --resume: the Trainer takes the model, optimizer and step; the data starts over, said so
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "trainer-run"
    capsys.readouterr()
    assert train_main([*MLP, "--resume", str(root / "step-00000006"), "--max-steps", "6",
                       "--run-dir", str(run_dir)]) == 0
    out_text = capsys.readouterr().out
    assert "resumed from" in out_text and "at step 6" in out_text and "holds no data position" in out_text
    weights = torch.load(run_dir / "checkpoints" / "step-00000006" / "model.pt", weights_only=True)
    assert all(torch.equal(weights[name], final[name]) for name in final)
    assert train_main([*MLP, "--resume", "auto", "--max-steps", "8", "--run-dir", str(run_dir)]) == 0
    assert (run_dir / "checkpoints" / "step-00000008").is_dir()


def _background_and_per_rank(ctx: DistContext, directory: str) -> dict[str, Any]:
    root = Path(directory)
    with Session("fp32", "cpu", backend="gloo", environ=os.environ) as session:
        torch.manual_seed(0)
        model = session.setup(nn.Linear(4, 2))
        before = {k: v.clone() for k, v in session.unwrap(model).state_dict().items()}
        assert session.save(root / "bg", {"model": model}, per_rank={"cursor": [ctx.rank, 10 * ctx.rank]},
                            background=True) is None
        with torch.no_grad():  # the next steps change the weights in place while rank 0 writes
            session.unwrap(model).weight.add_(1.0)
        saved = session.wait_for_save()
        written = torch.load(root / "bg" / "model.pt", weights_only=True)
        loaded = session.load(root / "bg", {})
        blocked = root / "blocked"
        if ctx.rank == 0:
            blocked.write_text("a file where the checkpoint's folder must go")
        session.all_gather_objects(None)  # the file exists before anyone saves under it
        session.save(blocked / "ckpt", {"model": model}, background=True)
        failure = ""
        try:
            session.wait_for_save()
        except CheckpointError as error:
            failure = str(error)
        session.save(root / "last", {"model": model}, background=True)  # leaving the block waits for it
    return {"committed": saved is not None and saved.path == root / "bg" and saved.background,
            "copied_at_the_call": all(torch.equal(written[k], before[k]) for k in before),
            "own_cursor": loaded["cursor"], "failure": failure}


def test_background_saves_and_per_rank_entries_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(_background_and_per_rank, 2, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        assert result["committed"] and result["copied_at_the_call"]
        assert result["own_cursor"] == [rank, 10 * rank]
        assert "checkpoint" in result["failure"] and "blocked" in result["failure"]  # the same error on both
    assert (tmp_path / "last" / "manifest.json").is_file()
    with Session("fp32", "cpu", environ={}) as session:  # one rank cannot take two ranks' cursors
        with pytest.raises(UsageError, match="a per-rank entry saved by 1 rank"):
            session.load(tmp_path / "bg", {"cursor": object()})
