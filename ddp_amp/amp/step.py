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

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ddp_amp.amp.scaler import AgreedGradScaler


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


def amp_step(scaler: AgreedGradScaler, optimizers: Sequence[torch.optim.Optimizer], *,
             clip_grad_norm: float | None = None, update: bool = True,
             skip_together: bool = False) -> StepResult:
    """Unscale, clip, step each optimizer unless any rank saw inf/NaN, update once (collective).

    `clip_grad_norm`: one total norm over all given optimizers' gradients, in real units;
    None for no clipping. `update=False` leaves the scale alone, for all but the last call of
    a step whose optimizers are stepped in several calls. Each optimizer skips on an inf in
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
        grad_norm = nn.utils.clip_grad_norm_(_stepped_params(optimizers), clip_grad_norm)
    for optimizer in optimizers:
        scaler.step(optimizer)
    if not update:
        return StepResult(None, grad_norm)
    scaler.update()
    return StepResult(scaler.last_step_skipped(), grad_norm)
