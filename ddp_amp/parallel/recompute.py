"""Activation checkpointing per shard unit: `full` recomputes a unit's forward in its backward,
`selective` keeps what is costly to recompute and recomputes the rest.

Selective keeps the outputs of the matrix products and attention (`aten.mm`, `addmm`, `bmm`,
`baddbmm` and the fused attention kernels), which hold most of a transformer block's FLOPs,
and recomputes the element-wise ops, norms and activations between them, which hold most of
its saved bytes but cost little to redo: the FLOPs recomputed are a small share of a full
recompute's (docs/sharding.md has the memory figures). The policy is torch's
`create_selective_checkpoint_contexts`; both modes use the composable `checkpoint`, which
keeps parameter names, so a sharded checkpoint's names stay the model's own.

Selective checkpointing replays the forward's ops by their count: every op seen in the
recompute must have been seen, as many times, in the forward. The profiler's annotations
(`record_function`) are not: the composable form recomputes by calling the unit again, so
FSDP2's pre-forward hook, which ran before the region in the forward, runs inside it in the
recompute, and with parameters gathered in bf16 it annotates its input cast there
(`FSDP::cast_forward_inputs`; torch 2.13). An annotation computes nothing, so neither mode
has anything to keep of it: both let it through, as torch's own `SAC_IGNORED_OPS` lets
through the `detach`es that checkpointing itself adds in differing numbers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ddp_amp.torch_api import (SAC_IGNORED_OPS, CheckpointPolicy, composable_checkpoint,
                               create_selective_checkpoint_contexts)

# The ops whose outputs selective checkpointing keeps: matrix products and fused attention.
# Looked up by name, as which attention kernels exist depends on the build (CPU, CUDA, cuDNN).
_KEPT_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm")
KEPT_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _KEPT_NAMES if hasattr(torch.ops.aten, name))

# The profiler's annotation ops (`record_function`'s enter and exit): they compute nothing.
ANNOTATION_OPS = frozenset(getattr(getattr(torch.ops.profiler, name), overload)
                           for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
                           for overload in getattr(torch.ops.profiler, name).overloads())


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_units(units: list[nn.Module], mode: str) -> None:
    """Checkpoint each unit in place: `mode` "full" or "selective" ("none" leaves them)."""
    if mode == "none":
        return
    options: dict[str, Any] = {}
    if mode == "selective":
        # Torch's public set of the ops both modes let through, read at each op: the
        # annotations join it (idempotent; they are as inert in any other selective region).
        SAC_IGNORED_OPS.update(ANNOTATION_OPS)
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_products)
    for unit in units:
        composable_checkpoint(unit, **options)  # the composable form keeps parameter names
