"""Build trainers in-process the way `ddp_amp.train.train` does, and compare their states."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.metrics import QuietRunLog
from ddp_amp.session import Session
from ddp_amp.tasks import load_task
from ddp_amp.torch_api import DTensor
from ddp_amp.trainer import Trainer, seed_everything, session_for

TASK = "tests.plugins.ckpt_task:make_task"


class NoticeLog(QuietRunLog):
    """A silent run log that keeps every info/warn line, so tests can read the notices."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)

    def warn(self, message: str) -> None:
        self.lines.append("warning: " + message)


def config(**overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"task": TASK, "batch_size": 8, "device": "cpu", "log_every": 1000,
                              "precision": "fp32", "max_steps": 8}
    values.update(overrides)
    return TrainConfig(**values)


def build_trainer(cfg: TrainConfig, ctx: DistContext, root: Path | None) -> Trainer:
    """What `train()` does before `fit()`: seed, build the task, reseed per rank, build."""
    seed_everything(cfg.seed)
    task = load_task(cfg.task, cfg)
    seed_everything(cfg.seed + ctx.rank)
    return Trainer(session_for(cfg).start(), cfg, task, NoticeLog(ctx.rank), checkpoint_root=root)


def snapshot(trainer: Trainer) -> dict[str, Any]:
    """Everything exact resume must reproduce, copied off the live objects."""
    if trainer.schedule is not None:  # mid-run, the scheduler may still count skipped steps
        trainer.schedule.before_checkpoint()
    model = Session.unwrap(trainer.model)
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "scaler": trainer.scaler.state_dict(),
        "skipped": int(trainer.scaler.skipped_steps().item()),
        "scheduler": copy.deepcopy(trainer.scheduler.state_dict()) if trainer.scheduler else None,
        "step": trainer.step,
        "samples_seen": trainer.samples_seen,
        "data": trainer.stream.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }


def whole_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The user's module's state with every split or sharded tensor whole, on every rank
    (collective where the model is sharded: DTensors are gathered)."""
    state = Session.unwrap(model).state_dict()
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for name, value in state.items()}


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Recursive equality where tensors must match bit for bit (dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.dim() else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point and b.dim() else b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def straight_vs_resumed(ctx: DistContext, root: Path, steps: int, resume_at: int,
                        **overrides: Any) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """N straight steps, and k steps + save + a fresh trainer that loads + (N - k) steps."""
    cfg = config(max_steps=steps, **overrides)
    straight = build_trainer(cfg, ctx, None)
    for _ in range(steps):
        straight.train_step()
    expected = snapshot(straight)
    del straight
    first = build_trainer(cfg, ctx, root)
    for _ in range(resume_at):
        first.train_step()
    saved = first.save_checkpoint()
    assert saved is not None
    del first
    torch.manual_seed(12345)  # the resumed run must not depend on what the RNGs were before
    resumed = build_trainer(cfg, ctx, root)
    resumed.load_checkpoint(saved)
    while resumed.step < steps:
        resumed.train_step()
    return expected, snapshot(resumed), saved
