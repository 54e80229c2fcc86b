"""Section `memory`: what each rank holds of the model's state, replicated (DDP) and sharded (--shard).

One training step of a stack of `layers` Linear(width, width) layers (AdamW, fp32; about 50M
parameters at the default width 2048 and 12 layers) on 1, 2 and 4 ranks, each world in fresh
processes (gloo on CPU, NCCL on a GPU), replicated and then sharded. Per rank it counts the
bytes of what the rank holds itself: parameters, gradients (after backward) and optimizer
state (after the step); sharded, a DTensor's local shard only. Transient buffers (a unit's
gathered weights during its forward, activations) are not state and are not counted, except
what `--no-reshard-after-forward` keeps between forward and backward: the unsharded weights,
reported apart. Target: the sharded state per rank within 10% of 1/N of the replicated one.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import target_fields
from ddp_amp.distributed import BackendChoice, DeviceChoice, DistContext, local_numel_bytes
from ddp_amp.parallel import ShardOptions
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.session import Session
from ddp_amp.tasks.mlp import make_model
from ddp_amp.torch_api import DTensor

WIDTH, LAYERS = 2048, 12
RANKS = (1, 2, 4)
TARGET = 1.10  # sharded state per rank / (replicated state per rank / N)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def _held(ctx: DistContext, width: int, layers: int, shard: ShardOptions | None) -> dict[str, int]:
    """Collective: one step of the stack, and the bytes this rank holds of its state."""
    device: DeviceChoice = "cuda" if ctx.device.type == "cuda" else "cpu"
    backend: BackendChoice = "nccl" if ctx.backend == "nccl" else "gloo"
    with Session("fp32", device, backend, environ=os.environ, shard=shard) as session:
        torch.manual_seed(0)
        model = session.setup(make_model(width, width, width, layers), units=(nn.Linear,))
        plain = session.unwrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs = torch.randn(8, width, device=ctx.device)
        loss = model(inputs).square().mean()
        # Between forward and backward: what stays gathered (unsharded) besides the shards.
        kept = sum(p.numel() * p.element_size() for p in plain.parameters() if not isinstance(p, DTensor)) \
            if shard is not None else 0
        loss.backward()
        held = {"params": local_numel_bytes(plain.parameters()),
                "grads": local_numel_bytes(p.grad for p in plain.parameters() if p.grad is not None)}
        optimizer.step()
        held["optimizer"] = local_numel_bytes(_optimizer_tensors(optimizer))
        held["kept_between_forward_and_backward"] = kept
        del model, plain, optimizer, loss
    return held


def _world(ctx: DistContext, width: int, layers: int) -> dict[str, dict[str, int]]:
    """Collective: the largest holdings of any rank, replicated, sharded, and sharded without
    resharding after forward."""
    variants = {"replicated": None, "sharded": ShardOptions(),
                "sharded, no reshard after forward": ShardOptions(reshard_after_forward=False)}
    return {name: _held(ctx, width, layers, options) for name, options in variants.items()}


def run(device: str, width: int = WIDTH, layers: int = LAYERS, ranks: tuple[int, ...] = RANKS) -> dict[str, Any]:
    """Every world size's rows, each world in fresh processes."""
    backend = "nccl" if device == "cuda" else "gloo"
    rows: list[dict[str, Any]] = []
    for world in ranks:
        if device == "cuda" and world > torch.cuda.device_count():
            rows.append({"ranks": world, "skipped": f"needs {world} GPUs, {torch.cuda.device_count()} visible"})
            continue
        per_rank = run_ranks(_world, world, width, layers, device=device, backend=backend, timeout=900)
        for variant in per_rank[0]:
            held = {key: max(rank[variant][key] for rank in per_rank) for key in per_rank[0][variant]}
            held["state"] = held["params"] + held["grads"] + held["optimizer"]
            rows.append({"ranks": world, "variant": variant, **held})
    replicated = {row["ranks"]: row["state"] for row in rows if row.get("variant") == "replicated"}
    for row in rows:
        if row.get("variant", "").startswith("sharded"):
            ideal = replicated[row["ranks"]] / row["ranks"]
            row["of_ideal"] = row["state"] / ideal
            row.update(target_fields("sharded state / (replicated / N)", row["of_ideal"], TARGET))
    parameters = layers * (width * width + width)
    return {"width": width, "layers": layers, "parameters": parameters, "rows": rows}


def _mib(row: dict[str, Any], key: str) -> str:
    return f"{row[key] / 2**20:.1f}" if key in row else ""


def memory_table(section: dict[str, Any]) -> str:
    """The section as the bench prints it, MiB per rank."""
    title = (f"State held per rank (the largest rank), {section['layers']} x Linear({section['width']},"
             f"{section['width']}), {section['parameters'] / 1e6:.1f}M parameters, AdamW, fp32")
    rows = [[row["ranks"], row.get("variant", row.get("skipped")),
             *(_mib(row, key)
               for key in ("params", "grads", "optimizer", "state", "kept_between_forward_and_backward")),
             f"{row['of_ideal']:.3f}" if "of_ideal" in row else ""] for row in section["rows"]]
    return title + "\n" + grid(["ranks", "variant", "params MiB", "grads MiB", "optimizer MiB", "state MiB",
                                "kept fwd->bwd MiB", "state / (DDP / N)"], rows)
