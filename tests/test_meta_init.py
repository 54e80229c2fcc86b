"""A model built sharded (`Task.build_model`, `Session.build_model`): each rank draws one
parameter at a time in full and keeps only its rows, and the sharded model equals a plain
build's, parameter for parameter, on real gloo ranks (a 2 x 2 HSDP mesh, and 2 ranks through
the CLI); init code a shard cannot replay is refused in one line."""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from ddp_amp import DistContext, Session, UsageError
from ddp_amp.parallel import ShardOptions, ShardSlot, build_sharded
from ddp_amp.parallel.row_draws import fill_rows
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


@pytest.mark.parametrize("op, args", [(torch.ops.aten.uniform_.default, (-0.5, 2.0)),
                                      (torch.ops.aten.normal_.default, (0.1, 0.02))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fill_drawn_piece_by_piece_keeps_the_full_fills_rows_and_stream(op: Any, args: tuple[float, float],
                                                                          dtype: torch.dtype) -> None:
    # FSDP2's rows, and tensor parallel's cuts before them: along the rows, or of columns (a rowwise split)
    slots = (ShardSlot(4, 0), ShardSlot(4, 3), ShardSlot(3, 1), ShardSlot(2, 1, split=2, split_index=1, split_dim=0),
             ShardSlot(2, 0, split=2, split_index=1, split_dim=1), ShardSlot(1, 0, split=3, split_index=2, split_dim=1))
    for shape in [(301, 16), (11, 6), (37, 7, 3), (5,), (3, 5)]:  # tails under 16 elements, odd rows
        for slot in [slot for slot in slots if slot.split_dim is None or slot.split_dim < len(shape)]:
            torch.manual_seed(7)
            full = torch.empty(shape, dtype=dtype)
            op(full, *args)
            after = torch.get_rng_state()
            torch.manual_seed(7)
            kept = torch.empty(slot.rows(full).shape, dtype=dtype)
            fill_rows(op, args, {}, full.numel(), dtype, slot.flat_ranges(full.shape), kept.view(-1),
                      torch.empty(32 + 15, dtype=dtype), piece=32)
            assert torch.equal(kept, slot.rows(full)) and torch.equal(torch.get_rng_state(), after), (shape, slot)
            assert kept.shape == full[slot.region(full.shape)].shape


def _build_peak(ctx: DistContext) -> float:
    """A fresh process's peak growth while it builds its quarter of 8 x Linear(2048, 2048), over that quarter."""
    def stack() -> nn.Module:
        return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
    build_sharded(lambda: nn.Linear(4, 4), ShardSlot(4, 0))  # first-use costs before the baseline
    baseline = psutil.Process().memory_info().rss
    model = build_sharded(stack, ShardSlot(4, 1))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del model
    return (peak - baseline) / (8 * 2048 * 2048 * 4 / 4)


def test_a_sharded_build_holds_its_rows_and_never_a_parameter_in_full() -> None:
    # Each weight is 16 MiB, a quarter of the stack 32 MiB: drawn in full, one weight alone
    # would add half the quarter (1.62 x measured so); drawn piece by piece the rows and a
    # 4 MiB piece are all (1.13 x).
    (growth,) = run_ranks(_build_peak, 1)
    assert growth < 1.3, growth


class BuildsOtherwiseOnMeta(nn.Module):
    """A model whose construction depends on where it is built: the meta pass's plan cannot hold."""

    def __init__(self) -> None:
        super().__init__()
        wide = torch.empty(0).is_meta
        self.a, self.b = nn.Linear(6, 8 if wide else 4), nn.Linear(4, 4)


UNLOADED = ("model.norm.weight", "model.layers.1.mlp.up_proj.weight")
SKIP_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[list[str]], list[str]]]] = {
    "all": (_llama, lambda names: names),  # every parameter loaded: nothing drawn
    "some": (_llama, lambda names: [n for n in names if n not in UNLOADED]),
    "diverged": (BuildsOtherwiseOnMeta, lambda names: names),  # the plan does not hold: everything drawn
}


def _skips(ctx: DistContext) -> dict[str, Any]:
    """Collective: each case built with its `overwritten` names; what was drawn, and the stream after."""
    found: dict[str, Any] = {}
    with Session("fp32", "cpu", "gloo", environ=os.environ, shard=ShardOptions()) as session:
        for case, (factory, chosen) in SKIP_CASES.items():
            torch.manual_seed(3)
            plain = factory()
            plain_stream = torch.get_rng_state()
            parameters = [name for name, _ in plain.named_parameters(remove_duplicate=False)]  # a tied one's both
            overwritten = chosen(parameters)
            start = torch.manual_seed(3).get_state()
            model = session.unwrap(session.setup(session.build_model(factory, overwritten)))
            stream = torch.get_rng_state()
            state = {name: value.full_tensor() if isinstance(value, DTensor) else value
                     for name, value in model.state_dict().items()}
            expected = plain.state_dict()
            found[case] = {
                "zero": sorted(name for name in parameters if not state[name].any()),
                "as_plain": sorted(name for name in expected if torch.equal(state[name], expected[name])),
                "names": sorted(expected), "overwritten": sorted(overwritten),
                "stream_untouched": torch.equal(stream, start), "stream_as_plain": torch.equal(stream, plain_stream),
                "up_std": float(state["model.layers.1.mlp.up_proj.weight"].std()) if case == "some" else 0.0}
    with Session("fp32", "cpu", "gloo", environ=os.environ, shard=ShardOptions(replicate=2)) as session:
        found["described"] = session.describe(session.setup(session.build_model(_llama)))
    with Session("fp32", "cpu", "gloo", environ=os.environ) as session:  # built whole, for DDP
        plain = _llama()
        start = torch.manual_seed(3).get_state()
        whole = session.build_model(_llama, [name for name, _ in plain.named_parameters(remove_duplicate=False)])
        found["whole"] = {"stream_untouched": torch.equal(torch.get_rng_state(), start),
                          "zero": all(not p.any() for p in whole.parameters()),
                          "buffers_as_plain": all(torch.equal(a, b) for a, b in zip(whole.buffers(), plain.buffers())),
                          "tied": whole.lm_head.weight is whole.model.embed_tokens.weight}
    return found


def test_a_build_draws_no_init_for_what_the_load_fills_and_the_rest_as_its_init_says() -> None:
    rank_zero, rank_one = run_ranks(_skips, 2, timeout=300)
    assert rank_zero == rank_one
    every = rank_zero["all"]
    buffers = [name for name in every["names"] if name not in every["overwritten"]]  # the rotary frequencies
    assert every["stream_untouched"] and every["zero"] == every["overwritten"] and every["as_plain"] == buffers
    some = rank_zero["some"]
    # The two names not loaded are initialised, from the stream as the skipped draws left it.
    assert some["zero"] == some["overwritten"] and "model.norm.weight" in some["as_plain"]
    assert 0.015 < some["up_std"] < 0.025 and not some["stream_untouched"]  # Llama's init: normal, std 0.02
    diverged = rank_zero["diverged"]
    assert diverged["as_plain"] == diverged["names"] and diverged["stream_as_plain"] and diverged["zero"] == []
    assert rank_zero["whole"] == {"stream_untouched": True, "zero": True, "buffers_as_plain": True, "tied": True}
    # Two replicas of one rank each: the start line says so.
    assert rank_zero["described"].startswith("sharded over 1 rank, replicated 2 times: 2 x LlamaDecoderLayer")
