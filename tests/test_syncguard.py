"""The rank-consistency guard catches a rank whose parameters drifted, on real gloo ranks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.parallel import wrap_ddp
from ddp_amp.errors import TrainingHalted
from ddp_amp.guards import OverflowProbe
from ddp_amp.metrics import make_run_log
from ddp_amp.tasks import load_task
from ddp_amp.session import Session
from ddp_amp.trainer import Trainer, seed_everything, session_for
from tests.multiproc import run_ranks


def _train_then_perturb(ctx: DistContext) -> dict[str, object]:
    config = TrainConfig(task="mlp", max_steps=4, batch_size=16, log_every=100, device="cpu", precision="fp16",
                         check_sync_every=2, task_opt=("hidden=16", "samples=256"))
    seed_everything(config.seed)
    task = load_task("mlp", config)
    with tempfile.TemporaryDirectory() as run_dir:
        run_log = make_run_log(ctx.rank, Path(run_dir))
        trainer = Trainer(session_for(config).start(), config, task, run_log)
        trainer.fit()  # checks at steps 2 and 4 pass: DDP keeps the replicas equal
        trainer.watch.after_resume(trainer.step)  # and the post-resume check passes too
        if ctx.rank == 1:
            with torch.no_grad():
                Session.unwrap(trainer.model)[2].bias[0] += 1e-3  # drift on one rank only
        message = ""
        try:
            trainer.watch.after_resume(trainer.step)
        except TrainingHalted as error:
            message = str(error)
        run_log.close()
    return {"steps": trainer.step, "message": message, "forensics": _armed_forensics(ctx)}


def _armed_forensics(ctx: DistContext) -> dict[str, object]:
    """The overflow probe under DDP: nothing checked until armed, then the exact local names."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    probe = OverflowProbe(list(model.named_parameters()), ctx.rank)
    ddp = wrap_ddp(model, ctx.device)
    scale = float("inf") if ctx.rank == 1 else 1.0
    (ddp(torch.ones(2, 4)).sum() * scale).backward()  # before arming: nobody looked
    unarmed = probe.report(step=1, skipped=1)
    probe.arm()
    model.zero_grad(set_to_none=True)
    (ddp(torch.ones(2, 4)).sum() * scale).backward()  # armed: each rank's own gradients are checked
    armed = probe.report(step=2, skipped=1)
    probe.disarm()
    del ddp
    return {"unarmed": unarmed, "armed": armed, "hooks_left": probe.armed}


def test_guard_names_the_rank_and_parameter_that_drifted() -> None:
    results = run_ranks(_train_then_perturb, 2)
    assert [r["steps"] for r in results] == [4, 4]
    for result in results:  # every rank stops, with the same diagnosis
        message = str(result["message"])
        assert "ranks out of sync after resume at step 4" in message
        assert "rank 1 differs from rank 0 in parameters 2.bias" in message
        assert "0.weight" not in message  # only the parameter that differs is named
        forensics = result["forensics"]
        unarmed, armed = forensics["unarmed"], forensics["armed"]  # type: ignore[index]
        assert not unarmed["checked"] and unarmed["ranks"] == [], unarmed
        assert armed["checked"] and armed["ranks"] == [1], armed
        # The local gradients of rank 1, before DDP's reduction: every parameter saw the inf.
        assert sorted(armed["params"]["1"]) == ["0.bias", "0.weight", "1.bias", "1.weight"], armed
        assert not forensics["hooks_left"]  # type: ignore[index]
