"""The PyTorch AMP recipe, written by hand: its network, its data and its training step.

Network: `width -> width` Linear + ReLU, `layers - 1` times, then a Linear; MSE loss; SGD.
The data is a list of pre-made batches on the device, as in the recipe, so the timings
measure the training step and not a data pipeline. `HandLoop` is what a user would write
without ddp_amp: autocast around forward and loss, `GradScaler`, DDP, `scaler.step/update`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp.amp import Precision
from ddp_amp.amp.float8 import convert_linears
from ddp_amp.tasks.mlp import make_model
from ddp_amp.torch_api import fully_shard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RecipeSize:
    """Sizes of one benchmark model: the recipe's are width 4096, batch 512, 3 layers."""

    width: int = 4096
    batch: int = 512
    layers: int = 3

    def scaled(self, scale: float) -> RecipeSize:
        """Width and batch times `scale` (at least 8 each): the CPU-sized recipe."""
        return RecipeSize(max(8, round(self.width * scale)), max(8, round(self.batch * scale)), self.layers)

    def flops_per_step(self) -> float:
        """Model FLOPs of one training step: 6 x batch x weights (forward 2, backward 4)."""
        return 6.0 * self.batch * self.layers * self.width * self.width


def make_batches(size: RecipeSize, count: int, device: torch.device,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (input, target) batches from a fixed seed: the same data for every trial."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        x = torch.randn(size.batch, size.width, generator=generator)
        y = torch.randn(size.batch, size.width, generator=generator)
        batches.append((x.to(device), y.to(device)))
    return batches


def seeded_model(size: RecipeSize, device: torch.device, seed: int = 0) -> nn.Module:
    """The recipe network with the same initial weights on every rank and every call."""
    torch.manual_seed(seed)
    return make_model(size.width, size.width, size.width, size.layers).to(device)


def sync(device: torch.device) -> None:
    """Wait for the device, so a wall-clock reading covers the work queued before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HandLoop:
    """The recipe's loop under DDP (or FSDP2: `shard`), as users write it: the baseline ddp_amp is
    compared with.

    `compile_model` compiles the model before DDP wraps it, the order torch's DDP and
    compile tutorials show; fp8 converts the linear layers first, as torchao's does.
    """

    def __init__(self, model: nn.Module, precision: Precision, device: torch.device, distributed: bool,
                 lr: float = 1e-3, fused: bool | None = None, set_to_none: bool = True,
                 bucket_view: bool = False, static_graph: bool = False,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
                 optimizer: str = "sgd", compile_model: bool = False, shard: bool = False) -> None:
        self.device, self.precision, self.set_to_none, self.loss_fn = device, precision, set_to_none, loss_fn
        if precision.float8_linears:
            model = convert_linears(model, emulate=precision.emulate_fp8)
        if compile_model:
            compiled = torch.compile(model)
            if not isinstance(compiled, nn.Module):  # an OptimizedModule; the stubs say only "a callable"
                raise TypeError(f"torch.compile of a module gave a {type(compiled).__name__}")
            model = compiled
        if shard:  # FSDP2 as its tutorial writes it: each block with parameters, then the root
            for block in [child for child in model.children() if any(True for _ in child.parameters())]:
                fully_shard(block)
            fully_shard(model)
        elif distributed:
            device_ids = [device.index] if device.type == "cuda" else None
            model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=bucket_view,
                        static_graph=static_graph)
        self.model = model
        # fused=None: the optimizer's default kernels; False: foreach; True: fused.
        kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
        self.optimizer = kind(model.parameters(), lr=lr, fused=True if fused else None,
                              foreach=True if fused is False else None)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.uses_loss_scaling)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One optimizer step on one batch; returns the loss (a device tensor, not read)."""
        inputs, target = batch
        with torch.autocast(self.device.type, dtype=self.precision.dtype,
                            enabled=self.precision.autocast_enabled):
            output = self.model(inputs)
            loss = self.loss_fn(output, target)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        return loss.detach()
