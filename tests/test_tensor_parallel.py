"""Tensor parallel on real gloo ranks: a transformers Llama split by its own plan (sequence and loss
parallel), alone and inside the data-parallel dimensions, trains as one rank does.

`causal_lm` on a tiny Llama (text and masked conversations, fp32, 10 SGD steps with clipping):
TP 2 on 2 ranks, TP 2 x shard 2 and TP 2 x replicate 2 on 4 give the 1-rank run's step losses
within 1e-5 relative, and its weights after the 10 steps within 1e-5. Trainers are built
in-process on each rank as `ddp_amp.train` builds them; the module fixture runs every shape
once and the tests read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.distributed import DistContext
from ddp_amp.torch_api import TENSOR_PARALLEL
from tests.multiproc import run_ranks
from tests.resume_harness import build_trainer, config, whole_state
from tests.text_model import conversations, corpus_documents, make_model_dir, write_jsonl
from tests.torch_features import needs

pytestmark = needs(TENSOR_PARALLEL)

STEPS, SEQ, BATCH = 10, 96, 8
# (tensor parallel, --shard, ranks): the shapes of the same global batch
SHAPES = {"tp2": (2, False, 2), "tp2 x shard2": (2, True, 4), "tp2 x replicate2": (2, False, 4)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tp")
    return {"model": make_model_dir(folder / "model", vocab_size=256, width=32, layers=2, heads=2,
                                     max_positions=128),
            "text": write_jsonl(folder / "text.jsonl", [{"text": d} for d in corpus_documents(60)]),
            "chat": write_jsonl(folder / "chat.jsonl", conversations(60)), "cache": folder / "cache"}


def _config(corpus: dict[str, Path], tensor_parallel: int = 1, shard: bool = False, **overrides: Any) -> Any:
    return config(task="causal_lm", task_opt=(f"model={corpus['model']}", f"max_length={SEQ}",
                                              "lr_scheduler_type=constant"),
                  data=(str(corpus["text"]), f"{corpus['chat']}:0.5"), data_cache=str(corpus["cache"]),
                  batch_size=BATCH, optimizer="sgd", lr=0.5, clip_grad_norm=1.0, max_steps=STEPS, eval_every=0,
                  tensor_parallel=tensor_parallel, shard=shard, **overrides)


def _train(ctx: DistContext, corpus: dict[str, Path], shapes: list[tuple[int, bool]]) -> list[dict[str, Any]]:
    """Collective: STEPS steps in each shape; the logged losses, the whole weights, the layout."""
    runs = []
    for tensor_parallel, shard in shapes:
        trainer = build_trainer(_config(corpus, tensor_parallel, shard), ctx, None)
        losses = [trainer._mean_across_ranks(trainer.train_step()) for _ in range(STEPS)]
        runs.append({"losses": losses, "weights": whole_state(trainer.model), "layout": trainer.layout})
        del trainer
    return runs


@pytest.fixture(scope="module")
def trained(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    results = {"1 rank": run_ranks(_train, 1, corpus, [(1, False)], timeout=600)[0][0]}
    for ranks in (2, 4):
        names = [name for name, shape in SHAPES.items() if shape[2] == ranks]
        done = run_ranks(_train, ranks, corpus, [SHAPES[name][:2] for name in names], timeout=900)[0]
        results.update(zip(names, done))
    return results


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_split_model_trains_as_one_rank_does(shape: str, trained: dict[str, dict[str, Any]]) -> None:
    alone, split = trained["1 rank"], trained[shape]
    assert split["layout"].startswith("tensor parallel over 2 ranks (sequence parallel, loss parallel)"), split
    assert split["losses"] == pytest.approx(alone["losses"], rel=1e-5), (shape, split["losses"], alone["losses"])
    assert alone["losses"][-1] < alone["losses"][0]  # it trained
    worst = max((_relative(split["weights"][name], value), name) for name, value in alone["weights"].items())
    assert worst[0] <= 1e-5, worst
