"""Section `transformer`: a GPT-2-small-shaped decoder, the Trainer against the hand loop.

For each precision (fp32, bf16, fp16, fp8), eager and compiled, in one fresh process per
precision: the hand-written AMP loop and the Trainer on the same model (gpt.py), the same
synthetic token batches, the same fused AdamW, interleaved in blocks (stats.py). Each row
reports both step times, Trainer / hand, the Trainer's tokens/s, each contender's peak
device memory, and TFLOP/s and MFU from the FLOPs of one step counted by torch's
`FlopCounterMode` against the GPU's dense peak for that precision (peaks.py; none on a CPU).

Compiled rows compile the hand loop's model (`torch.compile(model)`, then DDP) and run the
Trainer with `--compile` (the model inside the autocast wrapper, and the loss on its own);
a third contender, the Trainer with only the model compiled, shows what compiling the loss
adds. A precision the device cannot run (fp8 without float8 matmuls) is a row that says why.

Targets (`TARGETS`, stated for an H100, so checked on a GPU only): Trainer / hand in every
row, and the MFU of the compiled bf16 Trainer.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from dataclasses import asdict
from typing import Any

import torch

from ddp_amp.amp import Precision, resolve_precision
from ddp_amp.bench.gpt import CPU_SHAPE, GPTShape, next_token_loss, seeded_gpt, token_batches
from ddp_amp.bench.overhead import trainer_on_batches
from ddp_amp.metrics.throughput import counting_flops, utilization
from ddp_amp.bench.recipe import HandLoop
from ddp_amp.bench.stats import interleave, median_ms, paired_ratio
from ddp_amp.bench.targets import AT_LEAST, target_fields
from ddp_amp.distributed import DistContext
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.errors import UsageError
from ddp_amp.trainer.batch_loss import BatchLoss

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
N_BATCHES = 4
WARMUP_STEPS = 3  # compiling happens here, and the optimizer's state is made
TARGETS = {"trainer_over_hand": 1.02, "bf16_compiled_mfu": 0.5}  # on an H100


def step_flops(shape: GPTShape, precision: Precision, device: torch.device) -> int:
    """FLOPs of one training step (forward and backward) of an eager model, counted by torch."""
    model = seeded_gpt(shape, device, seed=1)
    tokens, targets = token_batches(shape, 1, device, seed=1)[0]

    def step() -> None:
        with precision.autocast():
            loss = next_token_loss(model(tokens), targets)
        loss.backward()

    return counting_flops(step)[1]


class _PeakMemory:
    """Each contender's peak device memory during its warm-up steps, net of the others' state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks_mb: dict[str, float | None] = {}

    def warm_up(self, name: str, step: Any, held_by_others: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(WARMUP_STEPS):
            step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peaks_mb[name] = (torch.cuda.max_memory_allocated(self.device) - held_by_others) / 2**20
        else:
            self.peaks_mb[name] = None  # a process's RSS cannot be split between contenders

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0


def _row(ctx: DistContext, shape: GPTShape, precision: Precision, compiled: bool, flops: int,
         blocks: int, steps: int) -> dict[str, Any]:
    """Collective: one precision, eager or compiled; contenders built and warmed up one by one."""
    device = ctx.device
    batches = token_batches(shape, N_BATCHES, device, seed=1 + ctx.rank)
    batch_bytes = sum(x.nbytes + y.nbytes for x, y in batches)
    memory = _PeakMemory(device)
    cycle = itertools.cycle(batches)
    hand = HandLoop(seeded_gpt(shape, device), precision, device, ctx.has_group, fused=True, bucket_view=True,
                    loss_fn=next_token_loss, optimizer="adamw", compile_model=compiled)
    memory.warm_up("hand", lambda: hand.step(next(cycle)), 0)
    names, contenders = ["hand"], [lambda: hand.step(next(cycle))]
    variants = [("trainer", compiled)] + ([("trainer_loss_eager", compiled)] if compiled else [])
    for name, compile_option in variants:
        held = memory.allocated() - batch_bytes  # the contenders so far, without the shared batches
        trainer = trainer_on_batches(ctx, seeded_gpt(shape, device), next_token_loss, precision, batches,
                                     optimizer="adamw", compile=compile_option)
        if name == "trainer_loss_eager":  # the model compiled, the loss not: a measurement
            trainer.micro.batch_loss = BatchLoss(trainer.task, compile_loss=False)
        memory.warm_up(name, trainer.train_step, held)
        names.append(name)
        contenders.append(trainer.train_step)
    times = interleave(contenders, blocks, steps, device)
    step_s = {name: statistics.median(t) for name, t in zip(names, times)}
    row: dict[str, Any] = {
        "precision": precision.name, "compiled": compiled, "ddp": ctx.has_group,
        "step_ms": {name: median_ms(t) for name, t in zip(names, times)},
        "peak_mem_mb": memory.peaks_mb,
        "trainer_over_hand": paired_ratio(times[0], times[1]),
        "tokens_per_s": shape.tokens_per_step * ctx.world_size / step_s["trainer"],
    }
    row["tflops"], row["mfu"] = utilization(flops, step_s["trainer"], device, precision.matmul_kind())
    if compiled:
        row["loss_eager_over_compiled"] = paired_ratio(times[1], times[2])
    return row


def _precision_rows(ctx: DistContext, shape: GPTShape, name: str, with_compile: bool, blocks: int,
                    steps: int) -> list[dict[str, Any]]:
    """Collective: the eager and (if asked) compiled rows of one precision, in this process."""
    try:
        precision = resolve_precision(name, ctx.device)
    except UsageError as error:  # fp8 where the device has no float8 matmuls: say why
        return [{"precision": name, "skipped": error.hint or str(error)}]
    flops = step_flops(shape, precision, ctx.device)
    rows = []
    for compiled in (False, True) if with_compile else (False,):
        try:
            rows.append(_row(ctx, shape, precision, compiled, flops, blocks, steps))
        except Exception as error:  # noqa: BLE001 - one failed row must not lose the others
            rows.append({"precision": name, "compiled": compiled, "failed": f"{type(error).__name__}: {error}"})
        torch.compiler.reset()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        row["flops_per_step"] = flops
    return rows


def run(device: str, with_compile: bool, blocks: int, steps: int, precisions: tuple[str, ...] = PRECISIONS,
        backend: str = "auto", batch: int | None = None) -> dict[str, Any]:
    """Every precision's rows, one fresh process per precision; the GPT-2 small shape on CUDA."""
    shape = GPTShape() if device == "cuda" else CPU_SHAPE
    shape = dataclasses.replace(shape, batch=batch) if batch else shape
    rows: list[dict[str, Any]] = []
    for name in precisions:
        rows += run_ranks(_precision_rows, 1, shape, name, with_compile, blocks, steps, device=device,
                          threads=0, backend=backend, timeout=1800)[0]
    parameters = sum(p.numel() for p in seeded_gpt(shape, torch.device("cpu")).parameters())
    section: dict[str, Any] = {"shape": asdict(shape), "parameters": parameters, "blocks": blocks,
                               "steps_per_block": steps, "targets": TARGETS, "rows": rows}
    compiled = {row["precision"]: row for row in rows if row.get("compiled") and "step_ms" in row}
    if "bf16" in compiled and "fp8" in compiled:
        section["fp8_speedup_over_bf16_compiled"] = (compiled["bf16"]["step_ms"]["trainer"]
                                                     / compiled["fp8"]["step_ms"]["trainer"])
    add_targets(section, device)
    return section


def add_targets(section: dict[str, Any], device: str) -> None:
    """Every row's Trainer / hand and the compiled bf16 MFU against `TARGETS` (a GPU's)."""
    not_here = "" if device == "cuda" else f"a GPU's target, stated for an H100; this run is on {device}"
    for row in section["rows"]:
        ratio = row.get("trainer_over_hand")  # none in a failed row: not measured
        row["target_checks"] = [target_fields("trainer / hand", ratio["median"] if ratio else None,
                                              TARGETS["trainer_over_hand"],
                                              not_here=not_here or row.get("skipped", ""))]
    bf16 = next((row for row in section["rows"] if row["precision"] == "bf16" and row.get("compiled")), None)
    why = not_here or ("no compiled bf16 row in this run: it needs bf16 among the precisions, and compiling"
                       if bf16 is None else "")
    if not why and bf16 is not None and "failed" not in bf16 and bf16.get("mfu") is None:
        why = "no known dense bf16 peak for this GPU"
    section["target_checks"] = [target_fields("compiled bf16 MFU", bf16.get("mfu") if bf16 else None,
                                              TARGETS["bf16_compiled_mfu"], AT_LEAST, why)]
