"""Activation checkpointing per shard unit: `full` recomputes a unit's forward in its backward,
`selective` keeps what is costly to recompute and recomputes the rest.

Selective keeps the outputs of the matrix products and attention (`aten.mm`, `addmm`, `bmm`,
`baddbmm` and the fused attention kernels), which hold most of a transformer block's FLOPs,
and recomputes the element-wise ops, norms and activations between them, which hold most of
its saved bytes but cost little to redo: the FLOPs recomputed are a small share of a full
recompute's (docs/sharding.md has the memory figures). The policy is torch's
`create_selective_checkpoint_contexts`; both modes use the composable `checkpoint`, which
keeps parameter names, so a sharded checkpoint's names stay the model's own.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# The ops whose outputs selective checkpointing keeps: matrix products and fused attention.
# Looked up by name, as which attention kernels exist depends on the build (CPU, CUDA, cuDNN).
_KEPT_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm")
KEPT_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _KEPT_NAMES if hasattr(torch.ops.aten, name))


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_units(units: list[nn.Module], mode: str) -> None:
    """Checkpoint each unit in place: `mode` "full" or "selective" ("none" leaves them)."""
    if mode == "none":
        return
    from torch.distributed._composable import checkpoint  # the composable form keeps parameter names
    options: dict[str, Any] = {}
    if mode == "selective":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_products)
    for unit in units:
        checkpoint(unit, **options)
