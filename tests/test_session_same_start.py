"""A sharded `Session.setup` starts every rank from rank 0's weights, as DDP does: a script
that seeds each rank differently (nanoGPT seeds `1337 + rank`) still trains one model."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ddp_amp import DistContext, Session
from ddp_amp.parallel import ShardOptions
from tests.multiproc import run_ranks
from tests.torch_features import needs_sharding

pytestmark = needs_sharding


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.norm = nn.BatchNorm1d(8)  # a buffer too: running statistics
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(self.norm(x))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The user's module's whole parameters and buffers (collective where they are sharded)."""
    state = Session.unwrap(model).state_dict()
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in state.items()}


def _seeded_by_rank(ctx: DistContext) -> dict[str, Any]:
    """Collective: each rank seeded differently, one SGD step replicated and sharded."""
    results: dict[str, Any] = {}
    for shard in (False, True):
        torch.manual_seed(1337 + ctx.rank)
        plain = _Blocks()
        own_init = {name: value.clone() for name, value in plain.state_dict().items()}
        with Session("fp32", "cpu", backend="gloo", environ=os.environ,
                     shard=ShardOptions() if shard else None) as session:
            model = session.setup(plain)
            start = _full(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            batch = torch.Generator().manual_seed(ctx.rank)  # each rank its own data, the same in both runs
            inputs, target = torch.randn(16, 8, generator=batch), torch.randn(16, 1, generator=batch)
            loss = (model(inputs) - target).square().mean()
            session.backward(loss)
            session.step(optimizer)
            name = "sharded" if shard else "replicated"
            results[name] = {"own_init": own_init, "start": start, "stepped": _full(model)}
            del model, optimizer
    return results


def test_a_sharded_setup_starts_every_rank_from_rank_zeros_weights_and_steps_as_ddp() -> None:
    rank0, rank1 = run_ranks(_seeded_by_rank, 2, timeout=300)
    # the ranks did start from different inits, so the broadcast is what made them agree
    assert not torch.equal(rank0["sharded"]["own_init"]["head.weight"], rank1["sharded"]["own_init"]["head.weight"])
    for name, value in rank0["sharded"]["own_init"].items():
        assert torch.equal(rank0["sharded"]["start"][name], value), name
        assert torch.equal(rank1["sharded"]["start"][name], value), name
        assert torch.equal(rank0["replicated"]["start"][name], value), name  # DDP's own broadcast
    # the parameters after one step are DDP's (buffers are not: DDP broadcasts them every
    # forward, FSDP2 keeps each rank's own running statistics)
    parameters = [name for name, _ in _Blocks().named_parameters()]
    for name in parameters:
        replicated = rank0["replicated"]["stepped"][name]
        torch.testing.assert_close(rank0["sharded"]["stepped"][name], replicated, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(rank1["sharded"]["stepped"][name], replicated, rtol=1e-6, atol=1e-7, msg=name)
