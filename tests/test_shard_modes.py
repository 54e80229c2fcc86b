"""Every combination of the `--shard` modes trains or is refused in one line.

The modes: `--compile`, `--activation-checkpointing none|full|selective`,
`--shard-param-dtype fp32|bf16`, plain sharding or HSDP (`--replicate 2`) and `--precision
fp32|bf16|fp16`: 72 combinations. One is refused, bf16 gathers under fp16 compute (docs/
sharding.md), in one line from the flags and from a `Session`. The rest are covered by all
pairs rather than the full product: the 9 cells of `CELLS` hold every pair of values of any
two modes (`test_the_cells_hold_every_pair_of_modes` checks it), the reported crash
(selective checkpointing with bf16 gathers, eager and compiled) among them. On 2 real gloo
ranks of the `lm` task (HSDP as 2 replicas of 1 shard: the 2-D mesh, its all-reduce across
replicas and its checkpoints; 2 x 2 is tests/test_hsdp.py's), in the same two processes
(`in_turn`: one start-up), each cell builds a Trainer with its modes, resumes the checkpoint
of the cell before it (another combination of modes; the first cell, run again at the end,
resumes the last), trains 2 steps to finite losses and saves. Compiled cells need a C++
compiler for inductor and are left out where there is none. About 60 s on 2 loaded cores
with inductor's cache cold, most of it compiling the 3 compiled cells.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from ddp_amp import DistContext, Session, TrainConfig, UsageError
from ddp_amp.command_line import parse_command_line
from ddp_amp.metrics import QuietRunLog
from ddp_amp.parallel import ShardOptions
from ddp_amp.tasks import load_task
from ddp_amp.torch_api import TENSOR_PARALLEL
from ddp_amp.trainer import Trainer, seed_everything, session_for
from tests.multiproc import in_turn, run_ranks
from tests.test_shard_compile import _inductor_compiler
from tests.torch_features import needs, needs_sharding

pytestmark = needs_sharding

MODES: dict[str, tuple[Any, ...]] = {"compile": (False, True), "checkpointing": ("none", "full", "selective"),
                                     "gather": ("fp32", "bf16"), "replicate": (1, 2),
                                     "precision": ("fp32", "bf16", "fp16")}
# (compile, checkpointing, gather, replicate, precision), in the order they run: each resumes the one before.
CELLS: list[tuple[Any, ...]] = [
    (True, "selective", "bf16", 1, "bf16"),
    (False, "selective", "bf16", 2, "fp32"),
    (False, "full", "fp32", 1, "fp16"),
    (True, "none", "fp32", 2, "fp16"),
    (False, "none", "fp32", 2, "bf16"),
    (True, "full", "fp32", 2, "fp32"),
    (False, "none", "bf16", 1, "fp32"),
    (False, "full", "bf16", 1, "bf16"),
    (False, "selective", "fp32", 1, "fp16"),
]
REFUSED = {"gather": "bf16", "precision": "fp16"}  # the one pair refused: bf16 weights for fp16 compute
LM_OPTIONS = ("emsize=16", "nhid=16", "vocab=100", "tokens=3000", "bptt=8", "dropout=0")
STEPS = 2


def _refused(cell: dict[str, Any]) -> bool:
    return all(cell[mode] == value for mode, value in REFUSED.items())


def test_the_cells_hold_every_pair_of_modes() -> None:
    wanted = set()
    for (a, values_a), (b, values_b) in itertools.combinations(MODES.items(), 2):
        wanted |= {(a, x, b, y) for x in values_a for y in values_b if not _refused({a: x, b: y} | _others(a, b))}
    cells = [dict(zip(MODES, cell, strict=True)) for cell in CELLS]
    held = {(a, cell[a], b, cell[b]) for cell in cells for a, b in itertools.combinations(MODES, 2)}
    assert wanted - held == set() and not any(_refused(cell) for cell in cells)


def _others(a: str, b: str) -> dict[str, Any]:
    """Values for the modes other than `a` and `b` that keep a pair of them from looking refused."""
    return {mode: None for mode in MODES if mode not in (a, b)}


def _config(cell: dict[str, Any], tensor_parallel: int = 1) -> TrainConfig:
    # Split over both ranks (TP 2) the data-parallel dimension has one rank: the replicate mode
    # then picks between sharding it (--shard) and replicating it (without), one rank each.
    shard, replicate = (cell["replicate"] == 1, 1) if tensor_parallel > 1 else (True, cell["replicate"])
    return TrainConfig(task="lm", task_opt=LM_OPTIONS, device="cpu", batch_size=4, eval_every=0, log_every=10**6,
                       shard=shard, compile=cell["compile"], activation_checkpointing=cell["checkpointing"],
                       shard_param_dtype=cell["gather"], replicate=replicate, precision=cell["precision"],
                       max_steps=10**6, tensor_parallel=tensor_parallel)


def _cell(ctx: DistContext, root: Path, index: int, resume: Path | None, name: str,
          tensor_parallel: int = 1) -> dict[str, Any]:
    """Collective: cell `index` resumes `resume` (none for the first), trains STEPS steps and
    saves under root/name."""
    from torch._dynamo.utils import counters  # dynamo's tally of the graphs it compiled in this process

    config = _config(dict(zip(MODES, CELLS[index], strict=True)), tensor_parallel)
    seed_everything(config.seed)
    task = load_task("lm", config)
    seed_everything(config.seed + ctx.rank)
    graphs = counters["stats"]["unique_graphs"]
    with session_for(config) as session:
        trainer = Trainer(session, config, task, QuietRunLog(ctx.rank), checkpoint_root=root / name)
        if resume is not None:
            trainer.load_checkpoint(resume)
        first = trainer.step
        losses = [float(trainer.train_step()) for _ in range(STEPS)]
        result = {"from": first, "to": trainer.step, "losses": losses, "saved": trainer.save_checkpoint(),
                  "layout": trainer.layout, "graphs": counters["stats"]["unique_graphs"] - graphs}
        del trainer
    return result


def _refusal(ctx: DistContext) -> str:
    """A sharded Session asked for bf16 gathers under fp16: its one-line refusal."""
    with pytest.raises(UsageError) as refused:
        Session("float16", "cpu", shard=ShardOptions(param_dtype="bf16")).start()
    return str(refused.value)


def _chain(root: Path, compiler: bool, tensor_parallel: int = 1) -> tuple[list[int], list[tuple[Any, ...]]]:
    """The cells this machine runs (compiled ones only with a compiler; split, the first of
    them only: compiling is most of the chain's time), each resuming the one before, and the
    first once more resuming the last, so that every cell's checkpoint is resumed by another;
    with each one's call for in_turn."""
    compiled = [index for index, cell in enumerate(CELLS) if cell[0]][:1 if tensor_parallel > 1 else None]
    cells = [index for index, cell in enumerate(CELLS) if (compiler and index in compiled) or not cell[0]]
    run = [*cells, cells[0]]
    calls = [(_cell, root, index, root / f"run-{position - 1}" / f"step-{STEPS * position:08d}" if position else None,
              f"run-{position}", tensor_parallel) for position, index in enumerate(run)]
    return run, calls


def test_every_cell_trains_two_steps_from_the_checkpoint_of_another_and_the_refused_one_says_so(
        tmp_path: Path) -> None:
    run, calls = _chain(tmp_path, _inductor_compiler() is not None)
    ranks = run_ranks(in_turn, 2, *calls, (_refusal,), timeout=600)
    for rank, results in enumerate(ranks):
        *cells, refusal = results
        for position, (index, result) in enumerate(zip(run, cells, strict=True)):
            compiled, checkpointing, gather, replicate, _ = CELLS[index]
            where = (rank, CELLS[index], result)
            assert result["from"] == STEPS * position and result["to"] == STEPS * (position + 1), where
            assert all(math.isfinite(loss) for loss in result["losses"]), where
            assert result["saved"] is not None, where
            layout = result["layout"]
            assert ("each unit compiled" in layout) == compiled, where
            # Dynamo made graphs for a compiled cell (the first cell, run again, reuses its own).
            assert (result["graphs"] > 0) == (compiled and index not in run[:position]), where
            assert (f"{'selective ' if checkpointing == 'selective' else ''}activation checkpointing per unit"
                    in layout) == (checkpointing != "none"), where
            assert ("parameters gathered in bf16" in layout) == (gather == "bf16"), where
            assert ("replicated 2 times" in layout) == (replicate == 2), where
        assert "\n" not in refusal and refusal.startswith("ShardOptions.param_dtype='bf16'"), refusal
        assert 'precision="bf16"' in refusal, refusal


@needs(TENSOR_PARALLEL)
def test_every_cell_trains_split_over_two_ranks_and_resumes_another(tmp_path: Path) -> None:
    """The same cells with the model split over both ranks (TP 2), one of them compiled: each trains
    from another's checkpoint; the replicate mode picks --shard (1) or none (2) for the one
    data-parallel rank."""
    run, calls = _chain(tmp_path, _inductor_compiler() is not None, tensor_parallel=2)
    for rank, cells in enumerate(run_ranks(in_turn, 2, *calls, timeout=900)):
        for position, (index, result) in enumerate(zip(run, cells, strict=True)):
            compiled, checkpointing, gather, _, _ = CELLS[index]
            where = (rank, CELLS[index], result)
            assert result["from"] == STEPS * position and result["to"] == STEPS * (position + 1), where
            assert all(math.isfinite(loss) for loss in result["losses"]), where
            layout = result["layout"]
            assert layout.startswith("tensor parallel over 2 ranks (loss parallel)"), where
            assert ("each unit compiled" in layout) == compiled, where
            if index not in run[:position]:  # run again on a new mesh, the first cell's guards may recompile
                assert (result["graphs"] > 0) == compiled, where
            assert ("activation checkpointing per unit" in layout) == (checkpointing != "none"), where
            assert ("parameters gathered in bf16" in layout) == (gather == "bf16"), where


def test_bf16_gathers_under_fp16_are_refused_in_one_line_naming_both_flags() -> None:
    with pytest.raises(UsageError) as refused:
        parse_command_line(["--shard", "--shard-param-dtype", "bf16", "--precision", "fp16"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--shard-param-dtype='bf16'"), message
    assert "--precision fp16" in message and "--precision bf16" in message, message
