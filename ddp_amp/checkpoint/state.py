"""What a checkpoint holds, captured from and restored into the live training objects.

Files of one checkpoint (all loadable with `torch.load(weights_only=True)`):
- `model.pt`: the user's module's `state_dict()` (no DDP `module.` / wrapper prefixes), so it
  loads into a plain `nn.Module`;
- `train.pt`: optimizer, scaler (+ its skipped-step count), scheduler, step, samples seen and
  the data position;
- `rng.pt`: every rank's python / numpy / torch / CUDA RNG states, in rank order;
- `meta.json`: world size, batch geometry, precision, config, ddp_amp and torch versions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ddp_amp.data import BatchStream
from ddp_amp.scaler import AgreedGradScaler

MODEL_FILE, TRAIN_FILE, RNG_FILE, META_FILE = "model.pt", "train.pt", "rng.pt", "meta.json"


@dataclass
class TrainingParts:
    """The live objects a checkpoint reads from and writes into."""

    model: nn.Module  # the user's module, unwrapped
    optimizer: torch.optim.Optimizer
    scaler: AgreedGradScaler
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    stream: BatchStream
    device: torch.device


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states, as tensors, ints and tuples only (weights_only-safe)."""
    # numpy's legacy state is a tuple with an ndarray, which weights_only refuses without
    # allow-listing numpy classes; as a tensor plus ints it loads as plain data.
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put this process's RNGs back to a state from `capture_rng`."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    saved = state["numpy"]
    np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["pos"],
                         saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng_states(device: torch.device) -> list[dict[str, Any]] | None:
    """Every rank's `capture_rng()` on rank 0 (rank order); None elsewhere (collective)."""
    own = capture_rng(device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [own]
    is_root = dist.get_rank() == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_root else None
    dist.gather_object(own, gathered, dst=0)
    return gathered


def capture_train_state(parts: TrainingParts, step: int, samples_seen: int) -> dict[str, Any]:
    """Optimizer, scaler, scheduler, counters and data position (the same on every rank)."""
    return {
        "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.scaler.state_dict(),
        "scaler_skipped_total": int(parts.scaler.skipped_steps().item()),
        "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
        "step": step,
        "samples_seen": samples_seen,
        "data": parts.stream.state_dict(),
    }


def describe_run(config: dict[str, Any], world_size: int, micro_batch_size: int, precision: str,
                 scaler_enabled: bool, step: int, batches_per_epoch: int) -> dict[str, Any]:
    """The JSON metadata a reader checks compatibility against before loading tensors."""
    import ddp_amp  # late: the package root imports modules that import this one

    return {
        "step": step,
        "world_size": world_size,
        "micro_batch_size": micro_batch_size,
        "batches_per_epoch": batches_per_epoch,
        "precision": precision,
        "loss_scaling": scaler_enabled,
        "config": config,
        "ddp_amp_version": ddp_amp.__version__,
        "torch_version": torch.__version__,
    }


def restore_train_state(parts: TrainingParts, model_state: dict[str, Any], state: dict[str, Any],
                        data_position: dict[str, int]) -> tuple[int, int]:
    """Load model, optimizer, scheduler and data position; returns (step, samples_seen).

    The scaler is restored separately (`load.restore_scaler`): it depends on precision.
    """
    parts.model.load_state_dict(model_state)
    parts.optimizer.load_state_dict(state["optimizer"])
    if parts.scheduler is not None and state["scheduler"] is not None:
        parts.scheduler.load_state_dict(state["scheduler"])
    parts.stream.load_state_dict(data_position)
    return int(state["step"]), int(state["samples_seen"])
