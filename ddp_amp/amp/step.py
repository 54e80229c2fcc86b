"""The one AMP step: scaled backward, then unscale, clip, agreed skip, update.

Both the Trainer and `Session` call these two functions; nothing else in ddp_amp steps an
optimizer under a scaler. The order, and why:
1. `scaled_backward`: the loss times the loss scale, so fp16 gradients do not underflow
   (a pass-through for bf16/fp32, whose scaler is disabled).
2. `unscale_` before clipping: clip thresholds are in real gradient units, not scaled
   ones; the agreed scaler also settles the skip decision across ranks here.
3. `scaler.step`: skips the update on every rank if any rank saw inf/NaN.
4. `scaler.update`: backs the scale off after a skip, grows it after a clean run; once per
   step, after every optimizer of the step has stepped.
What the step returns stays on the device: reading it is a host sync, so callers read it
at logging time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ddp_amp.amp.scaler import AgreedGradScaler
from ddp_amp.errors import UsageError
from ddp_amp.torch_api import DTensor, Replicate


class StepResult(NamedTuple):
    """What one AMP step did. Tensors stay on the device; read them at logging time.

    (A NamedTuple: made once per step, and cheaper to make than a frozen dataclass.)
    """

    # 0-d tensor: 1 if the step was skipped (inf/NaN on any rank), else 0. None with update=False.
    skipped: torch.Tensor | None
    # Total norm of the unscaled gradients before clipping. None without clipping.
    grad_norm: torch.Tensor | None


def scaled_backward(scaler: AgreedGradScaler, loss: torch.Tensor, **backward_options: Any) -> None:
    """Backward of the scaled loss; keywords (retain_graph, inputs) go to `backward`.

    Collective through a DDP model (its gradient all-reduce), except inside `no_sync`.
    """
    scaler.scale(loss).backward(**backward_options)


def _stepped_params(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [p for optimizer in optimizers for group in optimizer.param_groups
            for p in group["params"] if p.grad is not None]


def _named_params(clip_params: Iterable[torch.Tensor],
                  optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The caller's parameters, in the caller's order; each must be one the optimizers step,
    since only those are unscaled before clipping."""
    named = list(clip_params)
    stepped = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    strays = sum(id(p) not in stepped for p in named)
    if strays:
        raise UsageError("clip_params", f"{strays} of {len(named)} parameters not in the given optimizers",
                         "parameters the given optimizers step",
                         "pass the model's parameters and every optimizer that steps them")
    return [p for p in named if p.grad is not None]


def sharded_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads`, some of them DTensors (collective over their meshes).

    Each gradient's sum of squares is accumulated in fp64: torch 2.13's fp32 `vector_norm`
    on a CPU sums in fp32 and is off the exact norm by about n x 1e-11 for n elements
    (7e-5 for a 640k-element embedding), and how far off depends on how a tensor is split,
    so per-shard fp32 norms cannot equal one rank's norm of the whole gradient. In fp64 the
    norm rounds to the same fp32 value however the gradients are sharded. A DTensor's sum is
    its local shard's, summed over the mesh dimensions it is sharded on (a replicated
    dimension is not counted twice), with public collectives only: DTensor's own norm ops
    differ from one torch to the next (torch 2.15's `_foreach_norm` refuses a dtype on
    DTensors). The result is a plain tensor on the device, not read here.
    """
    device = grads[0].device
    squares = _sum_of_squares([g for g in grads if not isinstance(g, DTensor)], device)
    for mesh, dims, part in _by_sharding([g for g in grads if isinstance(g, DTensor)]):
        partial = _sum_of_squares([g.to_local() for g in part], device)
        for dim in dims:
            dist.all_reduce(partial, group=mesh.get_group(dim))
        squares = squares + partial
    return squares.sqrt().to(grads[0].dtype)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of `tensors`, in fp64, on `device`."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, 2, dtype=torch.float64).to(device) for t in tensors])
    return norms.square().sum()


def _by_sharding(grads: list[DTensor]) -> list[tuple[DeviceMesh, tuple[int, ...], list[DTensor]]]:
    """DTensors grouped by mesh and by the mesh dimensions they are sharded on, in the order
    each group first appears (the same on every rank, so the collectives pair up); one whose
    placements include a pending sum (Partial) is summed first."""
    groups: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, tuple[int, ...], list[DTensor]]] = {}
    for grad in grads:
        if any(placement.is_partial() for placement in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate() if placement.is_partial() else placement
                                                        for placement in grad.placements])
        # Sharded in any form: FSDP2 over a tensor-parallel split is a _StridedShard, whose
        # is_shard() is False (torch 2.13), though each rank holds its own part all the same.
        dims = tuple(dim for dim, placement in enumerate(grad.placements)
                     if not (placement.is_replicate() or placement.is_partial()))
        groups.setdefault((id(grad.device_mesh), dims), (grad.device_mesh, dims, []))[2].append(grad)
    return list(groups.values())


def clip_grads(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` so their total 2-norm is at most `max_norm`; the
    norm before clipping (collective where gradients are sharded).

    Plain gradients go through torch's own `clip_grad_norm_`, so a loop over the same
    parameters in the same order clips bitwise as a hand-written PyTorch loop does.
    Sharded ones need a norm that does not depend on the split (`sharded_grad_norm`);
    the scaling is torch's coefficient from that norm, multiplied into each rank's part of
    every gradient (a split model's gradients live on meshes of different dimensions, the
    split ones' and the rest's, which one multiply over DTensors refuses to mix).
    """
    if not any(isinstance(p.grad, DTensor) for p in params):
        return nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    total = sharded_grad_norm(grads)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch's clip_grads_with_norm_
    parts: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        part = grad.to_local() if isinstance(grad, DTensor) else grad
        parts.setdefault((part.device, part.dtype), []).append(part)
    for (device, _), same in parts.items():
        torch._foreach_mul_(same, coefficient.to(device))
    return total


def amp_step(scaler: AgreedGradScaler, optimizers: Sequence[torch.optim.Optimizer], *,
             clip_grad_norm: float | None = None, clip_params: Iterable[torch.Tensor] | None = None,
             update: bool = True, skip_together: bool = False) -> StepResult:
    """Unscale, clip, step each optimizer unless any rank saw inf/NaN, update once (collective).

    `clip_grad_norm`: one total norm over all given optimizers' gradients, in real units;
    None for no clipping. `clip_params` names the parameters to clip, in the order the norm
    sums them (`model.parameters()` for torch's `clip_grad_norm_(model.parameters(), c)`
    bitwise); by default the optimizers' parameters, in their order. `update=False` leaves
    the scale alone, for all but the last call of a step whose optimizers are stepped in
    several calls. Each optimizer skips on an inf in
    its own gradients, as torch's GradScaler does; `skip_together` makes one decision for
    all of them (the Trainer's several optimizers step together or not at all).
    """
    grad_norm = None
    together = skip_together and len(optimizers) > 1
    if clip_grad_norm is not None or together:
        for optimizer in optimizers:
            scaler.unscale_(optimizer)
    if together:
        scaler.skip_together(optimizers)
    if clip_grad_norm is not None:
        params = _stepped_params(optimizers) if clip_params is None else _named_params(clip_params, optimizers)
        grad_norm = clip_grads(params, clip_grad_norm)
    for optimizer in optimizers:
        scaler.step(optimizer)
    if not update:
        return StepResult(None, grad_norm)
    scaler.update()
    return StepResult(scaler.last_step_skipped(), grad_norm)
