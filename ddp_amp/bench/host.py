"""Section `host`: the Trainer's own host time per step, on a model whose compute is negligible.

A micro model (2 x Linear(16,16), batch 8) leaves almost nothing for the device to do, so
the difference between the Trainer's step and the hand-written AMP loop's is the Python and
dispatch work the Trainer adds: exactly what a fast GPU step pays on top of the hand loop
(the GPU waits for the host when the host is slower). It is measured on any machine, CPU
included, with one thread and the contenders interleaved in one process (stats.py).

Rows: fp32, bf16 and fp16, each without a process group (plain module, no DDP) and with a
group of one (the DDP path, gloo on CPU). Each row reports Trainer / hand (median of paired
block ratios) and the extra microseconds per step, against the target ratio, on any device
(`--check` compares every row that carries a target: targets.py).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from ddp_amp.bench.overhead import measure_contenders
from ddp_amp.bench.recipe import RecipeSize
from ddp_amp.bench.targets import target_fields
from ddp_amp.distributed import DistContext
from ddp_amp.distributed.spawn import run_ranks

MICRO = RecipeSize(width=16, batch=8, layers=2)
PRECISIONS = ("fp32", "bf16", "fp16")
# Trainer / hand in every row. The same on a GPU, where the micro model's step is all host
# time (the recipe model's stricter 1.02 is the overhead section's to show).
TARGET = 1.05
# Many pairs of short blocks: micro steps are short (docs/benchmarks.md, host time per step),
# and the quartiles of the paired ratio tighten with the number of pairs.
BLOCKS, STEPS_PER_BLOCK = 30, 60


def _rows(ctx: DistContext, blocks: int, steps: int) -> list[dict[str, Any]]:
    """Collective: one row per precision on this group (or none)."""
    rows = []
    for precision in PRECISIONS:
        measured = measure_contenders(ctx, MICRO, precision, blocks, steps)
        hand, trainer = measured["times"]
        extra_us = 1e6 * statistics.median(t - h for h, t in zip(hand, trainer))
        rows.append({"precision": precision, "ddp": ctx.has_group, "ranks": ctx.world_size,
                     "step_us": {"hand": 1e3 * measured["step_ms"]["hand"],
                                 "trainer": 1e3 * measured["step_ms"]["trainer"]},
                     "trainer_over_hand": measured["trainer_over_hand"], "extra_us": extra_us,
                     "target": TARGET})
    return rows


def run(device: str, blocks: int = BLOCKS, steps: int = STEPS_PER_BLOCK) -> dict[str, Any]:
    """Every row, one fresh single-threaded process per group setting."""
    rows: list[dict[str, Any]] = []
    for backend in ("auto", "gloo" if device == "cpu" else "nccl"):  # auto: no group for one process
        rows += run_ranks(_rows, 1, blocks, steps, device=device, threads=1, backend=backend, timeout=900)[0]
    for row in rows:
        row.update(target_fields("trainer / hand", row["trainer_over_hand"]["median"], row["target"]))
    return {"size": asdict(MICRO), "blocks": blocks, "steps_per_block": steps, "rows": rows}
