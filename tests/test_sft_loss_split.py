"""The SFT loss is the mean over every target token of an optimizer step, however the step is split.

One global batch of 16 masked conversation windows (assistant turns only are targets, so windows
hold unequal numbers of them), one SGD step in fp32 from the same weights: the update of 1 rank x
4 micro-batches, 2 x 2, 4 x 1 (micro-batch 4) and 2 x 1 (micro-batch 8), replicated (DDP) and
sharded, equals the update of one micro-batch of 16 on one rank to 1e-6 relative. A mean per
micro-batch, averaged, moved the same weights a third away (0.34 relative). The logged loss of
the step is that same token mean. Trainers built in-process on real gloo ranks, as `ddp_amp.train` builds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.distributed import DistContext
from ddp_amp.torch_api import SHARDING
from tests.multiproc import run_ranks
from tests.resume_harness import build_trainer, config, whole_state
from tests.text_model import conversations, make_model_dir, write_jsonl

GLOBAL_BATCH, SEQ, LR = 16, 96, 0.5
# (ranks, micro-batches per step); the micro-batch is GLOBAL_BATCH / (ranks x micro-batches)
SPLITS = {1: [(1, 1), (1, 4)], 2: [(2, 2), (2, 1)], 4: [(4, 1)]}


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("sft")
    return {"model": make_model_dir(folder / "model", vocab_size=512, width=32, layers=1, heads=2,
                                     max_positions=128),
            "chat": write_jsonl(folder / "chat.jsonl", conversations(120)), "cache": folder / "cache"}


def _one_step(ctx: DistContext, sft: dict[str, Path], root: Path, shard_modes: tuple[bool, ...]) -> dict[str, Any]:
    """Collective: one optimizer step for each split of this world size, replicated and sharded."""
    results: dict[str, Any] = {}
    for shard in shard_modes:
        for ranks, accum in SPLITS[ctx.world_size]:
            cfg = config(task="causal_lm", task_opt=(f"model={sft['model']}", f"max_length={SEQ}",
                                                     "lr_scheduler_type=constant"),
                         data=(str(sft["chat"]),), data_cache=str(sft["cache"]), batch_size=GLOBAL_BATCH,
                         grad_accum=accum, optimizer="sgd", lr=LR, max_steps=1, shard=shard, eval_every=0)
            trainer = build_trainer(cfg, ctx, root / f"{ranks}x{accum}-{shard}")
            before = whole_state(trainer.model)
            loss = trainer._mean_across_ranks(trainer.train_step())  # what the log records
            after = whole_state(trainer.model)
            results[f"{ranks}x{accum}" + (" sharded" if shard else "")] = {
                "update": {name: after[name] - before[name] for name in before}, "loss": loss}
    return results


def _relative(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    difference = sum(float((update[n] - reference[n]).double().norm() ** 2) for n in reference) ** 0.5
    return difference / sum(float(reference[n].double().norm() ** 2) for n in reference) ** 0.5


def test_every_split_of_a_step_trains_the_unsplit_update(sft: dict[str, Path], tmp_path: Path) -> None:
    modes = (False, True) if SHARDING.available() else (False,)
    results: dict[str, Any] = {}
    for world in SPLITS:
        results.update(run_ranks(_one_step, world, sft, tmp_path / str(world), modes, timeout=600)[0])
    reference = results.pop("1x1")
    assert any(float(u.abs().max()) > 0 for u in reference["update"].values())  # the step moved the weights
    assert len(results) == 4 * len(modes) + (len(modes) - 1)  # every split, and one rank's 16 sharded
    differences = {name: _relative(result["update"], reference["update"]) for name, result in results.items()}
    assert all(difference <= 1e-6 for difference in differences.values()), differences
    for name, result in results.items():
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-6), name
