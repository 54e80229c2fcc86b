"""`Session.build_model` under `shard=` leaves each rank's random stream where a plain build
leaves it: a script that seeds its ranks apart (nanoGPT: `1337 + rank`) draws the same
batches and dropout masks after the build as the same script under DDP, and the model is
still rank 0's, on 2 real gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ddp_amp import DistContext, Session
from ddp_amp.parallel import ShardOptions
from ddp_amp.torch_api import DTensor
from tests.multiproc import run_ranks
from tests.torch_features import needs_sharding

pytestmark = needs_sharding


class _Inits(nn.Module):
    """Uniform (Linear), normal (Embedding), a normal of fewer than 16 numbers (torch draws
    those one by one, keeping a cached sample), a truncated normal, an orthogonal init (a
    scratch tensor drawn, then copied) and a draw that is no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.gain = nn.Parameter(torch.empty(5).normal_())
        nn.init.trunc_normal_(self.blocks[0].weight, std=0.5)
        nn.init.orthogonal_(self.blocks[1].weight)
        self.jitter = float(torch.rand(()))


def _next_draws(ctx: DistContext) -> dict[str, Any]:
    """Collective: this rank's next draws after a sharded build and after a plain one, both
    seeded 1337 + rank, and whether the sharded model is rank 0's plain one."""
    torch.manual_seed(1337)
    reference = _Inits().state_dict()
    torch.manual_seed(1337 + ctx.rank)
    _Inits()
    after_plain = torch.randint(1000, (8,))
    with Session("fp32", "cpu", "gloo", environ=os.environ, shard=ShardOptions()) as session:
        torch.manual_seed(1337 + ctx.rank)
        built = session.build_model(_Inits)
        after_sharded = torch.randint(1000, (8,))
        state = session.unwrap(session.setup(built)).state_dict()
        whole = {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}
    return {"plain": after_plain, "sharded": after_sharded,
            "rank_zeros_model": all(torch.equal(whole[key], value) for key, value in reference.items())}


def test_a_sharded_build_leaves_each_ranks_stream_where_a_plain_build_does() -> None:
    ranks = run_ranks(_next_draws, 2, timeout=240)
    for rank, draws in enumerate(ranks):
        assert torch.equal(draws["sharded"], draws["plain"]), (rank, draws)
        assert draws["rank_zeros_model"], rank
    assert not torch.equal(ranks[0]["plain"], ranks[1]["plain"])  # the ranks were seeded apart
