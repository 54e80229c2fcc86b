"""Section 2: what ddp_amp's Trainer costs over the hand-written recipe loop, per step.

Contenders run interleaved in blocks inside one run on the same ranks (stats.py):
- `hand`: the recipe loop (autocast + GradScaler + DDP + scaler.step/update, recipe.py);
- `trainer`: ddp_amp's `Trainer.train_step` (AutocastModule under DDP, AgreedGradScaler);
- `agreement_cost`: the Trainer against itself with the scaler's found-inf all-reduce off
  (`agree_with_peers=False`), on the tiny model with fp32 compute (a CPU's slow fp16
  kernels would hide it): what the agreed skip decision costs per step with peers.
Both loops get the same model init, the same pre-made batches, the same precision, the
same optimizer kernels and the same DDP options, so the ratio is the launcher's own cost.
The Trainer's data stream is replaced by the same pre-made batches the hand loop uses.

Targets, Trainer / hand at most `TARGETS[model]`, are a GPU's: there the recipe model's
step has compute for the host time to hide behind, and the tiny model's has little. On a
CPU they do not apply (the host section holds the Trainer's own cost to its target there).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.bench.recipe import HandLoop, RecipeSize, make_batches, seeded_model
from ddp_amp.bench.stats import interleave, median_ms, paired_ratio
from ddp_amp.bench.targets import target_fields
from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.amp import Precision
from ddp_amp.amp.precision import as_precision_name
from ddp_amp.tasks import Task
from ddp_amp.trainer import Trainer, build_trainer, session_for

TINY = RecipeSize(width=256, batch=64, layers=2)  # Python overhead dominates its step
TARGETS = {"recipe_model": 1.02, "tiny_model": 1.05}  # Trainer / hand, on a GPU
N_BATCHES = 8  # distinct pre-made batches per rank, cycled


def make_trainer(ctx: DistContext, size: RecipeSize, precision: Precision,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], **options: Any) -> Trainer:
    """A Trainer on the recipe model whose data stream is the given pre-made batches."""
    return trainer_on_batches(ctx, seeded_model(size, ctx.device), nn.functional.mse_loss, precision, batches,
                              optimizer="sgd", **options)


def trainer_on_batches(ctx: DistContext, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                       precision: Precision, batches: list[tuple[torch.Tensor, torch.Tensor]],
                       optimizer: str, **options: Any) -> Trainer:
    """A Trainer on `model` whose data stream cycles through `batches` (already on the device).

    `options` are further `TrainConfig` fields (compile, static_graph, ...). The Trainer's
    session joins `ctx`'s group (it stays the caller's) and lives as long as the process.
    """
    config = TrainConfig(batch_size=batches[0][0].shape[0] * ctx.world_size, max_steps=10**9,
                         log_every=10**9, optimizer=optimizer, lr=1e-3, precision=precision.name,
                         fp8_emulate=precision.emulate_fp8, device=ctx.device.type, backend=ctx.backend or "auto",
                         **options)
    inputs = torch.cat([x.cpu() for x, _ in batches])
    targets = torch.cat([y.cpu() for _, y in batches])
    task = Task(model=model, train_data=TensorDataset(inputs, targets), loss_fn=loss_fn, name="bench")
    trainer = build_trainer(session_for(config).start(), config, task=task)
    trainer.stream = itertools.cycle(batches)  # type: ignore[assignment]  # the loop only iterates it
    return trainer


def hand_like(ctx: DistContext, size: RecipeSize, precision: Precision, trainer: Trainer) -> HandLoop:
    """The hand loop with the Trainer's optimizer kernels and DDP options."""
    fused = bool(trainer.optimizer.defaults.get("fused"))
    return HandLoop(seeded_model(size, ctx.device), precision, ctx.device, ctx.has_group,
                    fused=fused, bucket_view=True)


def _measure(ctx: DistContext, size: RecipeSize, precision_name: str, blocks: int, steps: int) -> dict[str, Any]:
    """Hand loop against Trainer on `size`, interleaved.

    Collective: every rank runs the same interleaved schedule; rank 0's timings count.
    """
    precision = Precision(as_precision_name(precision_name), ctx.device.type)
    batches = make_batches(size, N_BATCHES, ctx.device, seed=1 + ctx.rank)
    cycle = itertools.cycle(batches)
    trainer = make_trainer(ctx, size, precision, batches)
    hand = hand_like(ctx, size, precision, trainer)
    names = ["hand", "trainer"]
    contenders = [lambda: hand.step(next(cycle)), lambda: trainer.train_step()]
    interleave(contenders, 1, 3, ctx.device)  # warm-up, not counted
    times = interleave(contenders, blocks, steps, ctx.device)
    result: dict[str, Any] = {
        "size": asdict(size), "precision": precision_name, "ranks": ctx.world_size, "ddp": ctx.has_group,
        "blocks": blocks, "steps_per_block": steps,
        "step_ms": {name: median_ms(t) for name, t in zip(names, times)},
        "trainer_over_hand": paired_ratio(times[0], times[1]),
        "agreements": trainer.session.scaler.agreements,
    }
    return result


def _agreement_cost(ctx: DistContext, blocks: int, steps: int) -> dict[str, Any]:
    """Tiny model, loss scaling on but fp32 compute: the agreement's cost without slow fp16 kernels.

    On a CPU without fp16 units a tiny fp16 step is several times slower than fp32, long
    enough to hide a collective's cost in its noise (docs/facts.md: "Low precision on a CPU
    without bf16/fp16 units is slow", "Timing noise"); with autocast off the step is as
    short as it gets while the scaler still runs its found-inf check and all-reduce.
    Collective: every rank runs the same schedule.
    """
    precision = Precision("fp16", ctx.device.type)
    batches = make_batches(TINY, N_BATCHES, ctx.device, seed=1 + ctx.rank)
    unagreed = make_trainer(ctx, TINY, precision, batches)
    agreed = make_trainer(ctx, TINY, precision, batches)
    unagreed.session.scaler.agree_with_peers = False  # on every rank alike: a measurement, not a run
    for trainer in (unagreed, agreed):  # the forward in fp32; the scaler keeps scaling
        trainer.session.local_module(trainer.model).precision = Precision("fp32", ctx.device.type)
    contenders = [lambda: unagreed.train_step(), lambda: agreed.train_step()]
    interleave(contenders, 1, 3, ctx.device)
    # The steps are short: more and longer blocks for the same wall time.
    times = interleave(contenders, 2 * blocks, 4 * steps, ctx.device)
    return {"size": asdict(TINY), "compute": "fp32 with loss scaling (autocast off)", "ranks": ctx.world_size,
            "blocks": 2 * blocks, "steps_per_block": 4 * steps,
            "step_ms": {"unagreed": median_ms(times[0]), "agreed": median_ms(times[1])},
            "agreed_over_unagreed": paired_ratio(times[0], times[1]),
            "agreements": agreed.session.scaler.agreements}


def _measure_both(ctx: DistContext, size: RecipeSize, precision_name: str, blocks: int,
                  steps: int) -> dict[str, Any]:
    """Collective: the recipe model, then the tiny model with the agreement's cost."""
    return {"recipe_model": _measure(ctx, size, precision_name, blocks, steps),
            "tiny_model": _measure(ctx, TINY, precision_name, blocks, steps),
            "agreement_cost": _agreement_cost(ctx, blocks, steps)}


def run(device: str, ranks: int, scale: float, precision: str, blocks: int, steps: int,
        threads: int = 0, backend: str = "auto") -> dict[str, Any]:
    """The overhead on the (scaled) recipe model and on the tiny model, `ranks` processes."""
    section = run_ranks(_measure_both, ranks, RecipeSize().scaled(scale), precision, blocks, steps, device=device,
                        threads=threads, backend=backend, timeout=1800)[0]
    add_targets(section, device)
    return section


def add_targets(section: dict[str, Any], device: str) -> None:
    """Each model's Trainer / hand against `TARGETS`, which apply on a GPU only."""
    not_here = "" if device == "cuda" else f"a GPU's target; this run is on {device}"
    for model, target in TARGETS.items():
        measured = section[model]["trainer_over_hand"]["median"]
        section[model].update(target_fields("trainer / hand", measured, target, not_here=not_here))
