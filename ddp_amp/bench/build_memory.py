"""Part of section `memory`: the peak host memory of one rank while a model is built and sharded.

A stack of `layers` Linear(width, width) layers (about 510M parameters, 1.9 GiB in fp32, at
the default width 4608 and 24 layers) is built and set up with `--shard` on 1, 2 and 4
ranks, each world and way in fresh processes (gloo on CPU), two ways:

- whole, then sharded: `factory()` on every rank, then `Session.setup` (today's way for a
  task that passes `model=`): every rank holds the whole fp32 model before it is sharded;
- built sharded: `Session.build_model(factory)` (a task's `build_model=`), then `setup`:
  each rank draws one parameter at a time in full and keeps only its rows.

Per rank it reads the resident memory just before the build (the process's baseline:
Python, torch, the process group) and the peak resident memory after setup
(`getrusage`'s `ru_maxrss`, the most this process ever held), and reports the peak's growth
over the baseline against 1/N of the model's fp32 bytes. Target, built sharded: at most
1.3 x that share (what it adds is one parameter drawn in full and one module's shards held
twice while they get their storage).
"""

from __future__ import annotations

import gc
import os
import resource
from typing import Any

import psutil
import torch
from torch import nn

from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import target_fields
from ddp_amp.distributed import BackendChoice, DeviceChoice, DistContext, local_numel_bytes
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.parallel import ShardOptions
from ddp_amp.session import Session
from ddp_amp.tasks.mlp import make_model

WIDTH, LAYERS = 4608, 24
RANKS = (1, 2, 4)
TARGET = 1.3  # peak growth per rank / (fp32 model bytes / N), built sharded
WAYS = {"whole, then sharded": False, "built sharded": True}


def _peak(ctx: DistContext, width: int, layers: int, built_sharded: bool) -> dict[str, int]:
    """Collective: build and shard the stack one way; this rank's baseline, peak and shard bytes."""
    device: DeviceChoice = "cuda" if ctx.device.type == "cuda" else "cpu"
    backend: BackendChoice = "nccl" if ctx.backend == "nccl" else "gloo"
    with Session("fp32", device, backend, environ=os.environ, shard=ShardOptions()) as session:
        def factory() -> nn.Module:
            return make_model(width, width, width, layers)
        gc.collect()
        baseline = psutil.Process().memory_info().rss
        torch.manual_seed(0)
        model = session.build_model(factory) if built_sharded else factory()
        wrapped = session.setup(model, units=(nn.Linear,))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        held = local_numel_bytes(session.unwrap(wrapped).parameters())
        del wrapped, model
    return {"baseline": baseline, "peak": peak, "held": held}


def run(device: str, width: int = WIDTH, layers: int = LAYERS, ranks: tuple[int, ...] = RANKS) -> dict[str, Any]:
    """Each world size's two rows (whole then sharded, built sharded), each in fresh processes."""
    backend = "nccl" if device == "cuda" else "gloo"
    model_bytes = layers * (width * width + width) * 4
    rows: list[dict[str, Any]] = []
    for world in ranks:
        if device == "cuda" and world > torch.cuda.device_count():
            rows.append({"ranks": world, "skipped": f"needs {world} GPUs, {torch.cuda.device_count()} visible"})
            continue
        for variant, built_sharded in WAYS.items():
            per_rank = run_ranks(_peak, world, width, layers, built_sharded, device=device, backend=backend,
                                 timeout=900)
            growth = max(max(0, rank["peak"] - rank["baseline"]) for rank in per_rank)
            row: dict[str, Any] = {"ranks": world, "variant": variant,
                                   "baseline": max(rank["baseline"] for rank in per_rank), "growth": growth,
                                   "held": max(rank["held"] for rank in per_rank),
                                   "of_share": growth / (model_bytes / world)}
            if built_sharded:
                row.update(target_fields("peak growth / (fp32 model / N)", row["of_share"], TARGET))
            rows.append(row)
    return {"width": width, "layers": layers, "parameters": model_bytes // 4, "model_bytes": model_bytes,
            "rows": rows}


def build_table(section: dict[str, Any]) -> str:
    """The rows as the bench prints them, MiB per rank."""
    title = (f"Peak host memory per rank while {section['layers']} x Linear({section['width']},{section['width']}) "
             f"({section['parameters'] / 1e6:.0f}M parameters, {section['model_bytes'] / 2**20:.0f} MiB fp32) is "
             "built and sharded: growth over the process's baseline")
    rows = [[row["ranks"], row.get("variant", row.get("skipped")),
             *(f"{row[key] / 2**20:.0f}" if key in row else "" for key in ("baseline", "growth", "held")),
             f"{row['of_share']:.2f}" if "of_share" in row else ""] for row in section["rows"]]
    return title + "\n" + grid(["ranks", "way", "baseline MiB", "peak growth MiB", "shards held MiB",
                                "growth / (model / N)"], rows)
