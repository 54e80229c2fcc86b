"""Section `host`: the host time per step of the Trainer and of a Session loop, on a model whose
compute is negligible.

A micro model (2 x Linear(16,16), batch 8) leaves almost nothing for the device to do, so
the difference between a loop's step and the hand-written AMP loop's is the Python and
dispatch work ddp_amp adds: exactly what a fast GPU step pays on top of the hand loop
(the GPU waits for the host when the host is slower). It is measured on any machine, CPU
included, with one thread and the contenders interleaved in one process (stats.py).

Contenders, interleaved in one process: the hand loop; the Trainer's step; and a loop
written on `Session`, as docs/library.md shows it (`session.autocast()`, forward
and loss, `session.backward`, `session.step`, `zero_grad`). Rows: fp32, bf16 and fp16,
each without a process group (plain module, no DDP) and with a group of one (the DDP
path, gloo on CPU), once for the Trainer and once for the Session loop; and, where torch
shards, fp32 and bf16 on 2 ranks sharded: the hand loop with FSDP2 as its tutorial writes
it (`fully_shard` per block, then the root) against the Session loop with `shard=`, where
the collectives are the same on both sides and what differs is ddp_amp's host work. Each row reports
loop / hand (median of paired block ratios) and the extra microseconds per step, against
the target ratio, on any device (`--check` compares every row that carries a target:
targets.py).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ddp_amp.amp import Precision
from ddp_amp.amp.precision import as_precision_name
from ddp_amp.bench.overhead import N_BATCHES, hand_like, make_trainer
from ddp_amp.bench.recipe import HandLoop, RecipeSize, make_batches, seeded_model
from ddp_amp.bench.stats import interleave, median_ms, paired_ratio
from ddp_amp.bench.targets import target_fields
from ddp_amp.distributed import BackendChoice, DeviceChoice, DistContext
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.parallel import ShardOptions
from ddp_amp.session import Session
from ddp_amp.torch_api import SHARDING

MICRO = RecipeSize(width=16, batch=8, layers=2)
PRECISIONS = ("fp32", "bf16", "fp16")
# Sharded rows: fp16's scaler under FSDP2 is ddp_amp's own (the hand loop's GradScaler would
# decide a skip from its own shards only), so no like-for-like hand loop exists for it.
SHARDED_PRECISIONS = ("fp32", "bf16")
# Trainer / hand and Session loop / hand in every row. The same on a GPU, where the micro
# model's step is all host time (the recipe model's stricter 1.02 is the overhead section's).
TARGET = 1.05
# Many pairs of short blocks: micro steps are short (docs/benchmarks.md, host time per step),
# and the median of the paired ratios settles with the number of pairs: with 30 its run-to-run
# spread on a 2-core CPU was about 0.02, as large as the margin being checked; 100 pairs
# (about a minute in all) halve it.
BLOCKS, STEPS_PER_BLOCK = 100, 60


def session_loop(ctx: DistContext, precision: Precision, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 fused: bool, shard: ShardOptions | None = None) -> Callable[[], torch.Tensor]:
    """One step of a loop written on `Session` over `batches`, the hand loop's model and optimizer.

    The session joins `ctx`'s group, which stays the caller's.
    """
    device: DeviceChoice = "cuda" if ctx.device.type == "cuda" else "cpu"
    backend: BackendChoice = "nccl" if ctx.backend == "nccl" else "gloo" if ctx.backend == "gloo" else "auto"
    session = Session(precision.name, device, backend, shard=shard).start()
    model = session.setup(seeded_model(MICRO, ctx.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    cycle = itertools.cycle(batches)

    def step() -> torch.Tensor:
        inputs, target = next(cycle)
        with session.autocast():
            loss = nn.functional.mse_loss(model(inputs), target)
        session.backward(loss)
        session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _stepping(hand: Any, batches: Iterator[Any]) -> Callable[[], object]:
    """One step of `hand` on the next of `batches`, per call."""
    return lambda: hand.step(next(batches))


def _rows(ctx: DistContext, blocks: int, steps: int) -> list[dict[str, Any]]:
    """Collective: a Trainer row and a Session row per precision on this group (or none)."""
    rows = []
    for name in PRECISIONS:
        precision = Precision(as_precision_name(name), ctx.device.type)
        batches = make_batches(MICRO, N_BATCHES, ctx.device, seed=1 + ctx.rank)
        trainer = make_trainer(ctx, MICRO, precision, batches)
        hand = hand_like(ctx, MICRO, precision, trainer)
        contenders = {"hand": _stepping(hand, itertools.cycle(batches)), "trainer": trainer.train_step,
                      "session": session_loop(ctx, precision, batches,
                                              fused=bool(hand.optimizer.defaults.get("fused")))}
        interleave(list(contenders.values()), 1, 3, ctx.device)  # warm-up, not counted
        times = dict(zip(contenders, interleave(list(contenders.values()), blocks, steps, ctx.device)))
        for loop in ("trainer", "session"):
            rows.append({"loop": loop, "precision": name, "ddp": ctx.has_group, "ranks": ctx.world_size,
                         "step_us": {"hand": 1e3 * median_ms(times["hand"]), loop: 1e3 * median_ms(times[loop])},
                         "over_hand": paired_ratio(times["hand"], times[loop]),
                         "extra_us": 1e6 * statistics.median(t - h for h, t in zip(times["hand"], times[loop])),
                         "target": TARGET})
    return rows


def _sharded_rows(ctx: DistContext, blocks: int, steps: int) -> list[dict[str, Any]]:
    """Collective: the Session loop with `shard=` against the hand FSDP2 loop, per precision."""
    rows = []
    for name in SHARDED_PRECISIONS:
        precision = Precision(as_precision_name(name), ctx.device.type)
        batches = make_batches(MICRO, N_BATCHES, ctx.device, seed=1 + ctx.rank)
        hand = HandLoop(seeded_model(MICRO, ctx.device), precision, ctx.device, True, fused=False, shard=True)
        contenders = {"hand": _stepping(hand, itertools.cycle(batches)),
                      "session": session_loop(ctx, precision, batches, fused=False, shard=ShardOptions())}
        interleave(list(contenders.values()), 1, 3, ctx.device)  # warm-up, not counted
        times = dict(zip(contenders, interleave(list(contenders.values()), blocks, steps, ctx.device)))
        rows.append({"loop": "session", "precision": name, "variant": f"sharded over {ctx.world_size} ranks",
                     "step_us": {"hand": 1e3 * median_ms(times["hand"]), "session": 1e3 * median_ms(times["session"])},
                     "over_hand": paired_ratio(times["hand"], times["session"]),
                     "extra_us": 1e6 * statistics.median(t - h for h, t in zip(times["hand"], times["session"])),
                     "target": TARGET})
    return rows


def run(device: str, blocks: int = BLOCKS, steps: int = STEPS_PER_BLOCK) -> dict[str, Any]:
    """Every row, one fresh single-threaded process per group setting."""
    rows: list[dict[str, Any]] = []
    for backend in ("auto", "gloo" if device == "cpu" else "nccl"):  # auto: no group for one process
        rows += run_ranks(_rows, 1, blocks, steps, device=device, threads=1, backend=backend, timeout=900)[0]
    if SHARDING.available() and device == "cpu":  # 2 ranks: on a GPU machine, one GPU each
        rows += run_ranks(_sharded_rows, 2, blocks, steps, device=device, threads=1, timeout=900)[0]
    for row in rows:
        row.update(target_fields(f"{row['loop']} / hand", row["over_hand"]["median"], row["target"]))
    return {"size": asdict(MICRO), "blocks": blocks, "steps_per_block": steps, "rows": rows}
