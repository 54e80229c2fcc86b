"""The data options of a run: the global batch, its accumulation micro-steps, loader workers."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.errors import UsageError
from ddp_amp.option_values import ComponentOptions, check_fields, option


@dataclass(frozen=True)
class DataOptions(ComponentOptions):
    """The batch geometry of one optimizer step, and each rank's loader."""

    batch_size: int = option(64, "global batch size per optimizer step, summed over ranks and "
                             "accumulation micro-steps; must divide by world size x --grad-accum",
                             resume="match", limits=(1, 2**31))
    grad_accum: int = option(1, "micro-steps accumulated per optimizer step (DDP syncs only on the last)",
                             resume="match", limits=(1, 2**31))
    num_workers: int = option(0, "DataLoader worker processes per rank", limits=(0, 256))

    def micro_batch_size(self, world_size: int) -> int:
        """Per-rank batch of one micro-step; raises if the global batch does not divide."""
        parts = world_size * self.grad_accum
        if self.batch_size % parts:
            raise UsageError("--batch-size", self.batch_size,
                             f"a multiple of world size x --grad-accum = {world_size} x "
                             f"{self.grad_accum} = {parts}",
                             f"try --batch-size {max(parts, self.batch_size // parts * parts)}")
        return self.batch_size // parts

    def check(self) -> None:
        """Choices and ranges."""
        check_fields(self, DataOptions)
