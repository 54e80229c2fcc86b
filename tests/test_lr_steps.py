"""The LR scheduler advances on taken fp16 steps only, reading the skip flags rarely."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ddp_amp.trainer.lr_steps import TakenStepScheduler
from ddp_amp.amp import AgreedGradScaler

Schedule = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
SCHEDULES: dict[str, Schedule] = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
    "epoch": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.95),  # like lm's
    "multistep": lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 9, 10, 20], gamma=0.3),
    "chained": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),  # changes every step
}


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")  # the reference, skipped steps
@pytest.mark.parametrize("fused", [False, True], ids=["host-lr", "planned-device-lr"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lr_follows_taken_steps_exactly(name: str, fused: bool) -> None:
    scaler = AgreedGradScaler("cpu", init_scale=2.0**4)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0, fused=fused)
    gated = TakenStepScheduler(SCHEDULES[name](optimizer), scaler)
    assert gated.planned == fused  # a fused kernel takes the LR as a device tensor
    # The reference steps its own scheduler only after reading each step's flag.
    reference_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    reference = SCHEDULES[name](reference_optimizer)
    generator = torch.Generator().manual_seed(1)
    overflows = [True, True] + (torch.rand(298, generator=generator) < 0.3).tolist()
    for step, overflow in enumerate(overflows):
        loss = (param * (float("inf") if overflow else 1.0)).sum()
        scaler.scale(loss).backward()
        gated.before_step()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        gated.after_step()
        if not scaler.last_step_skipped().item():
            reference.step()
        # The LR the next step will use is the reference's at every step, not just at the end
        # (planned: as the float32 the fused kernel computes with).
        assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(
            reference_optimizer.param_groups[0]["lr"], rel=1e-7 if fused else 1e-12), (name, step)
    if fused:  # planned: not one flag read in 300 steps (the plan covers 1024)
        assert gated.flag_reads == 0
    gated.settle()
    assert gated.scheduler.last_epoch == reference.last_epoch == overflows.count(False)
    # The flags are read where the LR would change, not every step. With 30% of the steps
    # skipped (real fp16 runs skip a few in thousands), a crossing that came early because
    # of skips is rewound and read again a few steps later: 8 reads for 2 epochs here.
    max_reads = {"epoch": 10, "multistep": 10, "step": len(overflows) // 2, "chained": len(overflows)}[name]
    assert gated.flag_reads <= max_reads, gated.flag_reads


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")  # no optimizer step here
def test_bf16_and_fp32_step_straight_through() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    gated = TakenStepScheduler(SCHEDULES["step"](optimizer), AgreedGradScaler("cpu", enabled=False))
    for _ in range(8):
        gated.after_step()
    assert gated.scheduler.last_epoch == 8 and optimizer.param_groups[0]["lr"] == 0.25
    assert gated.flag_reads == 0


def test_a_schedule_that_moves_other_hyperparameters_is_not_planned() -> None:
    # OneCycleLR cycles the momentum with the LR: a planned LR alone would leave it behind.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0, momentum=0.9, fused=True)
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=4000)
    gated = TakenStepScheduler(cycle, AgreedGradScaler("cpu", init_scale=2.0**4))
    assert not gated.planned and optimizer.param_groups[0]["momentum"] == pytest.approx(0.95)
    assert cycle.last_epoch == 0 and isinstance(optimizer.param_groups[0]["lr"], float)
