"""`parallelize`: one function makes a model ready, replicated or sharded on the group's mesh,
and a plan asking for what is not implemented yet is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ddp_amp.amp import AutocastModule, resolve_precision
from ddp_amp.distributed import DistContext
from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError
from ddp_amp.parallel import ParallelPlan, TensorParallelPlan, parallelize
from ddp_amp.torch_api import DTensor, FSDPModule
from tests.multiproc import run_ranks
from tests.torch_features import needs_sharding

CPU = torch.device("cpu")


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_a_world_of_one_gets_the_autocast_wrapper_around_the_users_module() -> None:
    model = _Blocks()
    made = parallelize(model, ParallelPlan(), resolve_precision("fp32", CPU), DistContext(DistEnv(), CPU, None))
    assert isinstance(made.model, AutocastModule) and made.model.unwrap() is model
    assert made.description == "replicated" and made.units == ()


def test_a_split_model_that_fsdp_does_not_spread_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as raised:
        ParallelPlan(tensor_parallel=TensorParallelPlan({"blocks.0": "colwise"}))
    message = str(raised.value)
    assert "ParallelPlan.tensor_parallel" in message and "shard=True" in message and "\n" not in message


def test_replicas_of_a_model_that_is_not_sharded_are_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as raised:
        ParallelPlan(replicate=2)
    message = str(raised.value)
    assert "replicate=2" in message and "shard=True" in message and "\n" not in message


def _sharded_layout(ctx: DistContext) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Blocks()
    made = parallelize(model, ParallelPlan(shard=True), resolve_precision("fp32", ctx.device), ctx)
    units = list(model.blocks)
    on_mesh = [all(isinstance(p, DTensor) and p.device_mesh is ctx.mesh for p in unit.parameters())
               for unit in units]
    return {"units_are_fsdp": [isinstance(unit, FSDPModule) for unit in units],
            "units_are_the_plans": [a is b for a, b in zip(made.units, units)] + [len(made.units) == len(units)],
            "on_mesh": on_mesh, "root_is_fsdp": isinstance(model, FSDPModule),
            "wrapper_around_root": isinstance(made.model, AutocastModule) and made.model.unwrap() is model,
            "mesh_dims": ctx.mesh.mesh_dim_names if ctx.mesh is not None else None,
            "description": made.description}


@needs_sharding
def test_sharded_every_unit_is_an_fsdp_module_on_the_groups_mesh() -> None:
    for layout in run_ranks(_sharded_layout, 2, timeout=240):
        assert layout["units_are_fsdp"] == [True, True] and layout["root_is_fsdp"]
        assert all(layout["units_are_the_plans"]) and layout["on_mesh"] == [True, True]
        assert layout["wrapper_around_root"] and layout["mesh_dims"] == ("dp",)
        assert layout["description"] == "sharded: 2 x Linear and the model as the root"
