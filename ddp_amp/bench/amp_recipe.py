"""Section 1: the AMP recipe's benchmark, fp32 vs autocast fp16 + GradScaler vs autocast bf16.

Each trial trains the same freshly seeded network on the same batches in a fresh process,
so one trial's memory peak (on CPU the process's peak RSS, a high-water mark that never
falls) cannot carry over into the next. docs/benchmarks.md (GPU figures) sets the
measured figures beside those the recipe publishes.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch

from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.bench.recipe import HandLoop, RecipeSize, make_batches, seeded_model, sync
from ddp_amp.distributed import DistContext
from ddp_amp.metrics import peak_memory_mb
from ddp_amp.errors import UsageError
from ddp_amp.amp import resolve_precision
from ddp_amp.metrics.peaks import dense_peak_tflops

TRIALS = ("fp32", "fp16", "bf16")
WARMUP_STEPS = 3

def _trial(ctx: DistContext, name: str, size: RecipeSize, batches: int, epochs: int) -> dict[str, Any]:
    """One trial in this (fresh) process: warm up, then time `epochs` x `batches` steps."""
    device = ctx.device
    at_start = peak_memory_mb(device)  # on CPU: the interpreter and torch itself
    try:
        precision = resolve_precision(name, device)
    except UsageError as error:  # e.g. bf16 on a GPU without bf16 units: the other trials still run
        return {"precision": name, "skipped": str(error)}
    data = make_batches(size, batches, device)
    loop = HandLoop(seeded_model(size, device), precision, device, distributed=False)
    for step in range(WARMUP_STEPS):  # first-call costs (allocator, kernels) are not the steady state
        loop.step(data[step % batches])
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    loss = torch.zeros(())
    for _ in range(epochs):
        for batch in data:
            loss = loop.step(batch)
    sync(device)
    total = time.perf_counter() - started
    steps = epochs * batches
    result = {"precision": name, "total_s": total, "step_ms": 1e3 * total / steps, "steps": steps,
              "peak_mem_mb": peak_memory_mb(device),
              "peak_over_start_mb": peak_memory_mb(device) - at_start, "final_loss": float(loss.float().item())}
    peak = dense_peak_tflops(device, "bf16")
    achieved = size.flops_per_step() * steps / total / 1e12
    result["tflops"] = achieved
    result["mfu_vs_bf16_peak"] = achieved / peak if peak else None
    return result


def run(device: str, scale: float, batches: int = 50, epochs: int = 3,
        trials: tuple[str, ...] = TRIALS, threads: int = 0) -> dict[str, Any]:
    """Run every trial in its own process; add each trial's speed-up over fp32."""
    size = RecipeSize().scaled(scale)
    rows = [run_ranks(_trial, 1, name, size, batches, epochs, device=device, threads=threads, timeout=1800)[0]
            for name in trials]
    base = next((row["total_s"] for row in rows if row["precision"] == "fp32" and "total_s" in row), None)
    for row in rows:
        if "total_s" in row:
            row["speedup_vs_fp32"] = base / row["total_s"] if base else None
    memory_kind = "torch.cuda.max_memory_allocated" if device == "cuda" else "process peak RSS"
    return {"size": asdict(size), "scale": scale, "batches": batches, "epochs": epochs,
            "memory": memory_kind, "trials": rows}
