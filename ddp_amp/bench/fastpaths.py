"""Section 3: one figure per fast path, each as a paired ratio `on / off` of per-step time.

Each comparison builds the two variants side by side on the same ranks, model init and
batches, and interleaves them (stats.py); below 1 means the fast path is faster. Loop-level
choices (optimizer kernels, `set_to_none`, `gradient_as_bucket_view`) use the hand-written
recipe loop; Trainer options (`--static-graph`, `--grad-comm-dtype`, `--compile`) the Trainer.
Pinned-memory non-blocking host-to-device copies only exist on CUDA and are skipped elsewhere.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from ddp_amp.bench.overhead import N_BATCHES, make_trainer
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.bench.recipe import HandLoop, RecipeSize, make_batches, seeded_model
from ddp_amp.bench.stats import interleave, median_ms, paired_ratio
from ddp_amp.distributed import DistContext
from ddp_amp.amp import Precision
from ddp_amp.amp.precision import as_precision_name

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Stepper = Callable[[], Any]


def _hand(ctx: DistContext, size: RecipeSize, precision: Precision, batches: Batches,
          **options: Any) -> Stepper:
    loop = HandLoop(seeded_model(size, ctx.device), precision, ctx.device, ctx.has_group, **options)
    cycle = itertools.cycle(batches)
    return lambda: loop.step(next(cycle))


def _trainer(ctx: DistContext, size: RecipeSize, precision: Precision, batches: Batches,
             **options: Any) -> Stepper:
    trainer = make_trainer(ctx, size, precision, batches, **options)
    return trainer.train_step


def _fused_available(device: torch.device) -> bool:
    try:
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device=device))], lr=0.1, fused=True)
        return True
    except (RuntimeError, ValueError):
        return False


def comparisons(device: torch.device, distributed: bool, with_compile: bool) -> list[tuple[str, Any, Any, str]]:
    """(name, off variant, on variant, note) for this device; a None variant means skipped."""
    hand, trainer = _hand, _trainer
    fused_note = "" if _fused_available(device) else "fused SGD unavailable here"
    ddp_note = "" if distributed else "needs a process group (ranks > 1, or --backend with one rank)"
    rows: list[tuple[str, Any, Any, str]] = [
        ("fused vs foreach optimizer", (hand, {"fused": False}),
         (hand, {"fused": True}) if not fused_note else None, fused_note),
        ("set_to_none vs zero-fill grads", (hand, {"set_to_none": False}), (hand, {"set_to_none": True}), ""),
        ("gradient_as_bucket_view", (hand, {"bucket_view": False}), (hand, {"bucket_view": True}), ddp_note),
        ("static_graph (--static-graph)", (trainer, {}), (trainer, {"static_graph": True}), ddp_note),
        ("bf16 grad comm (--grad-comm-dtype bf16)", (trainer, {}), (trainer, {"grad_comm_dtype": "bf16"}), ddp_note),
        ("fp16 grad comm (--grad-comm-dtype fp16)", (trainer, {}), (trainer, {"grad_comm_dtype": "fp16"}), ddp_note),
        ("torch.compile (--compile)", (trainer, {}), (trainer, {"compile": True}) if with_compile else None,
         "" if with_compile else "not run: pass --with-compile (compiling takes minutes on a CPU)"),
    ]
    return [(name, off, None if note else on, note) for name, off, on, note in rows]


def _pinned_h2d(device: torch.device, size: RecipeSize, repeats: int) -> dict[str, Any]:
    """Pageable blocking vs pinned non-blocking copy of one batch to the GPU."""
    host = torch.randn(size.batch, size.width)
    pinned = host.pin_memory()

    def timed(source: torch.Tensor, non_blocking: bool) -> list[float]:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            source.to(device, non_blocking=non_blocking)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        return times

    timed(host, False)  # warm-up
    off, on = timed(host, False), timed(pinned, True)
    return {"name": "pinned non-blocking H2D copy", "off_ms": median_ms(off), "on_ms": median_ms(on),
            "ratio": paired_ratio(off, on), "note": ""}


def _measure(ctx: DistContext, size: RecipeSize, precision_name: str, blocks: int, steps: int,
             with_compile: bool) -> list[dict[str, Any]]:
    """Collective: every rank builds and runs the same comparisons in the same order."""
    precision = Precision(as_precision_name(precision_name), ctx.device.type)
    batches = make_batches(size, N_BATCHES, ctx.device, seed=1 + ctx.rank)
    rows: list[dict[str, Any]] = []
    for name, off, on, note in comparisons(ctx.device, ctx.has_group, with_compile):
        if on is None:
            rows.append({"name": name, "skipped": note})
            continue
        contenders = [make(ctx, size, precision, batches, **options) for make, options in (off, on)]
        interleave(contenders, 1, 3, ctx.device)  # warm-up (and compile), not counted
        times = interleave(contenders, blocks, steps, ctx.device)
        rows.append({"name": name, "off_ms": median_ms(times[0]), "on_ms": median_ms(times[1]),
                     "ratio": paired_ratio(times[0], times[1]), "note": note})
        del contenders
    if ctx.device.type == "cuda":
        rows.append(_pinned_h2d(ctx.device, size, max(blocks, 5)))
    else:
        rows.append({"name": "pinned non-blocking H2D copy", "skipped": "CUDA only (no host-to-device copy on CPU)"})
    return rows


def run(device: str, ranks: int, scale: float, precision: str, blocks: int, steps: int,
        with_compile: bool, threads: int = 0, backend: str = "auto") -> dict[str, Any]:
    """Every fast-path comparison on the (scaled) recipe model, `ranks` processes."""
    size = RecipeSize().scaled(scale)
    rows = run_ranks(_measure, ranks, size, precision, blocks, steps, with_compile, device=device,
                     threads=threads, backend=backend, timeout=1800)[0]
    return {"size": {"width": size.width, "batch": size.batch, "layers": size.layers},
            "precision": precision, "ranks": ranks, "rows": rows}
