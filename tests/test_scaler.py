"""The agreed GradScaler: with 2 real gloo ranks, an inf on one rank only skips on both.

Rank 1's gradient is made non-finite *after* backward, so DDP's all-reduce cannot spread
it: only the scaler's own agreement can make both ranks take the same decision.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp.amp import AutocastModule, Precision
from ddp_amp.distributed import DistContext
from ddp_amp.amp import AgreedGradScaler
from tests.multiproc import run_ranks

INIT_SCALE = 2.0**16


def _one_step_with_local_inf(ctx: DistContext, scaler_kind: str, fused: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(AutocastModule(nn.Linear(8, 4), Precision("fp16", "cpu")))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    scaler = (AgreedGradScaler("cpu", init_scale=INIT_SCALE) if scaler_kind == "agreed"
              else torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
    loss = model(inputs).float().pow(2).mean()
    scaler.scale(loss).backward()
    if ctx.rank == 1:
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("inf")
    item_calls = 0
    real_item = torch.Tensor.item

    def counting_item(self: torch.Tensor) -> Any:
        nonlocal item_calls
        item_calls += 1
        return real_item(self)

    torch.Tensor.item = counting_item  # type: ignore[method-assign]
    try:
        scaler.step(optimizer)
        scaler.update()
    finally:
        torch.Tensor.item = real_item  # type: ignore[method-assign]
    params = [p.detach().clone() for p in model.parameters()]
    return {
        "scale": scaler.get_scale(),
        "stepped": any(not torch.equal(a, b) for a, b in zip(before, params)),
        "params": params,
        "item_calls": item_calls,
        "skipped": int(scaler.skipped_steps()) if isinstance(scaler, AgreedGradScaler) else None,
    }


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_agreed_scaler_skips_on_every_rank(fused: bool) -> None:
    rank0, rank1 = run_ranks(_one_step_with_local_inf, 2, "agreed", fused)
    assert not rank0["stepped"] and not rank1["stepped"]
    assert rank0["scale"] == rank1["scale"] == INIT_SCALE / 2
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))
    if fused:  # the fused optimizer receives the agreed flag on the device: no .item()
        assert rank0["item_calls"] == rank1["item_calls"] == 0


def test_plain_grad_scaler_lets_the_ranks_diverge() -> None:
    """The reason the agreed scaler exists: the same step with torch's own GradScaler."""
    rank0, rank1 = run_ranks(_one_step_with_local_inf, 2, "plain", True)
    assert rank0["stepped"] and not rank1["stepped"]
    assert rank0["scale"] == INIT_SCALE and rank1["scale"] == INIT_SCALE / 2
    assert not all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))


def test_disabled_scaler_passes_through_and_never_skips() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = AgreedGradScaler("cpu", enabled=False)
    before = model.weight.detach().clone()
    loss = scaler.scale(model(torch.ones(1, 2)).sum())
    loss.backward()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(before, model.weight) and int(scaler.skipped_steps()) == 0


def _train_with(scaler: torch.amp.GradScaler, kind: str, usage: str) -> tuple[list[torch.Tensor], list[float]]:
    """Ten fp16-scaled steps of two fused optimizers, infs at fixed steps: params and scales."""
    torch.manual_seed(0)
    body, head = nn.Linear(6, 6), nn.Linear(6, 2)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
            "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True)}[kind]
    optimizers = [make(body.parameters()), make(head.parameters())]
    inputs = torch.randn(10, 4, 6)
    scales = []
    for step in range(10):
        loss = head(torch.relu(body(inputs[step]))).pow(2).mean()
        scaler.scale(loss).backward()
        if step in (2, 3, 7):
            body.weight.grad[0, 0] = float("inf")
        if usage == "unscale_and_clip":
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_([*body.parameters(), *head.parameters()], 0.5)
        for optimizer in optimizers:
            scaler.step(optimizer)
            assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
        scaler.update()
        scales.append(scaler.get_scale())
        for optimizer in optimizers:
            optimizer.zero_grad()
    return [p.detach().clone() for p in [*body.parameters(), *head.parameters()]], scales


@pytest.mark.parametrize("usage", ["step", "unscale_and_clip"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_fused_optimizers_step_exactly_as_with_torchs_scaler(kind: str, usage: str) -> None:
    """The agreed scaler's own fused-optimizer step (no signature lookup, no copies of flag
    and scale) must update weights and scale bit for bit as torch's GradScaler does."""
    plain = _train_with(torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3), kind, usage)
    ours = _train_with(AgreedGradScaler("cpu", init_scale=2.0**12, growth_interval=3, min_scale=0.0), kind, usage)
    assert ours[1] == plain[1] and len(set(plain[1])) > 2  # the scale backed off and grew
    assert all(torch.equal(a, b) for a, b in zip(ours[0], plain[0]))


def test_fused_step_refuses_a_second_step_before_update() -> None:
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1, fused=True)
    scaler = AgreedGradScaler("cpu")
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(optimizer)
