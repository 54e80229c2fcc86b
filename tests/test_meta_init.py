"""A model built sharded (`Task.build_model`, `Session.build_model`): each rank draws one
parameter at a time in full and keeps only its rows, and the sharded model equals a plain
build's, parameter for parameter, on real gloo ranks (a 2 x 2 HSDP mesh, and 2 ranks through
the CLI); init code a shard cannot replay is refused in one line."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddp_amp import DistContext, Session, UsageError
from ddp_amp.parallel import ShardOptions, ShardSlot, build_sharded
from ddp_amp.tasks.lm import TransformerLM
from ddp_amp.torch_api import DTensor
from tests.multiproc import run_ranks, run_train
from tests.test_shard import LM
from tests.torch_features import needs_sharding

pytestmark = needs_sharding


class ManyInits(nn.Module):
    """The inits models use besides a layer's own: truncated normal (a rejection sampler that
    reads the values it drew), orthogonal (a QR of a scratch tensor, then a copy), a padding
    row zeroed, a parameter drawn at construction, a tied weight, a buffer computed."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 6, padding_idx=3)
        self.first = nn.Linear(6, 5)
        self.scale = nn.Parameter(torch.randn(5, 3))
        self.second = nn.Linear(5, 7)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embedding.weight
        nn.init.trunc_normal_(self.first.weight, std=0.5)
        nn.init.orthogonal_(self.second.weight)
        self.register_buffer("positions", torch.arange(9.0) / 9)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=301, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    return LlamaForCausalLM(config)


FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "lm": lambda: TransformerLM(301, 16, 2, 24, 2, 0.0),  # layers cloned by deepcopy, attention's own init
    "inits": ManyInits,
    "llama": _llama,
}


def _compare(ctx: DistContext, name: str) -> dict[str, Any]:
    """Collective: ranks seeded apart build `name` sharded; its full tensors against rank 0's plain build."""
    factory = FACTORIES[name]
    torch.manual_seed(100)  # rank 0's seed, below
    plain = factory()
    expected = {key: value.clone() for key, value in plain.state_dict().items()}
    torch.manual_seed(100 + ctx.rank)  # this rank's seed, below
    factory()
    after_plain = torch.get_rng_state()
    with Session("fp32", "cpu", "gloo", environ=os.environ, shard=ShardOptions(replicate=2)) as session:
        torch.manual_seed(100 + ctx.rank)
        built = session.build_model(factory)
        # Every rank's stream moves on as a plain build from its own seed moves it.
        stream_ok = torch.equal(torch.get_rng_state(), after_plain)
        metas = sum(p.is_meta for p in built.parameters())
        model = session.unwrap(session.setup(built))
        state = model.state_dict()
        mismatched = [key for key, value in expected.items()
                      if not torch.equal(value, state[key].full_tensor() if isinstance(state[key], DTensor)
                                         else state[key])]
        local_rows = {key: tuple(value.to_local().shape) for key, value in state.items() if isinstance(value, DTensor)}
    return {"names": sorted(state) == sorted(expected), "mismatched": mismatched, "metas": metas,
            "stream_ok": stream_ok, "local_rows": local_rows}


def _all(ctx: DistContext) -> dict[str, dict[str, Any]]:
    return {name: _compare(ctx, name) for name in FACTORIES}


def test_ranks_seeded_apart_build_sharded_exactly_rank_zeros_plain_model_on_an_hsdp_mesh() -> None:
    results = run_ranks(_all, 4, timeout=300)  # 2 replicas x 2 shards
    for rank, by_name in enumerate(results):
        for name, result in by_name.items():
            assert result["names"] and result["mismatched"] == [], (rank, name, result["mismatched"])
            assert result["metas"] == len(list(FACTORIES[name]().parameters())), (rank, name)  # nothing held whole
            assert result["stream_ok"], (rank, name)
    # Each shard holds its rows only: 301 rows of the lm's embedding split 151 + 150, alike on both replicas.
    rows = [by_name["lm"]["local_rows"]["embedding.weight"] for by_name in results]
    assert rows == [(151, 16), (150, 16), (151, 16), (150, 16)]


class OneRowLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.a.weight[0].zero_()  # a row of a parameter no longer held in full: b was drawn since


class NormBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("norm", self.a.weight.detach().norm())


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.gain = float(self.a.weight.detach().abs().max())


@pytest.mark.parametrize("factory, label", [(OneRowLater, "Linear.weight"), (NormBuffer, "NormBuffer.norm"),
                                            (ReadsAValue, "the model")])
def test_init_a_shard_cannot_replay_is_refused_in_one_line(factory: Callable[[], nn.Module], label: str) -> None:
    with pytest.raises(UsageError) as refused:
        build_sharded(factory, ShardSlot(2, 1))
    message = str(refused.value)
    assert "\n" not in message and label in message and "meta device" in message, message


def test_the_lm_task_built_sharded_trains_exactly_as_when_built_whole(tmp_path: Path) -> None:
    """The `lm` task builds its model with build_model; the plugin passes it whole (model=)."""
    runs = {"built": ["--task", "lm"], "whole": ["--task", "tests.plugins.lm_whole_task:make_task"]}
    losses = {}
    for name, task in runs.items():
        args = [*LM, *task, "--shard", "--max-steps", "4", "--run-dir", str(tmp_path / name)]
        result = run_train(args, nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "model=sharded: 2 x TransformerEncoderLayer" in result.stdout
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if "loss" in r and "step" in r]
    assert len(losses["built"]) == 4 and losses["built"] == losses["whole"]
