"""A GradScaler whose skip decision is the same on every rank.

Plain `torch.amp.GradScaler` decides per process. Where a rank's gradients were not all
reduced by DDP (parameters outside DDP, unused parameters, gradients changed after the
reduction by a hook or callback on some ranks only), one rank can find an inf that another
does not: it skips the step and halves its scale while the other steps, and the replicas
drift apart for good (tests/test_scaler.py shows it with two ranks).

Here the local found-inf flags are all-reduced with MAX right after they are computed, in
both of GradScaler's paths:
- `unscale_` (plain and foreach optimizers, and any explicit unscale before clipping);
- `_check_inf_per_device` (fused optimizers, where `step` hands the flag to the optimizer
  as a device tensor). The agreed flag stays on the device: no `.item()` on this path.

Why every rank runs the same collectives: whether the all-reduce runs depends only on the
process group (more than one rank) and on `agree_with_peers`, a setting fixed when the
scaler is made, never on a rank's own gradients or on what touched them. A per-rank
shortcut ("my gradients are provably DDP's reduced ones, skip the agreement") would be
decided from local facts, and a rank that alone failed the proof would run an all-reduce
its peers never join: a hang, or a pairing with the wrong collective. The agreement costs
one one-element all-reduce per optimizer step with peers (on the device, no host sync, on
NCCL); DeepSpeed and Megatron-LM pay the same for the same reason.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.amp.lossscale import OverflowCounters, next_scale


class AgreedGradScaler(torch.amp.GradScaler):
    """Drop-in `torch.amp.GradScaler` whose inf/NaN decision is agreed across ranks.

    Collective: `unscale_` and `step` run an all-reduce when a process group with more
    than one rank exists, so every rank must call them for the same optimizers in the
    same order (as DDP training does anyway).
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True,
                 process_group: dist.ProcessGroup | None = None,
                 hysteresis: int = 1, min_scale: float = 0.0) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = process_group
        # Loss-scale safety (lossscale.py). hysteresis=1, min_scale=0 is exactly
        # GradScaler's own update rule.
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.overflow_counters = OverflowCounters()
        # Device tensors, read only when someone asks (logging steps): reading them is a
        # device-to-host sync on CUDA.
        self._last_skipped: torch.Tensor | None = None
        self._skipped_total: torch.Tensor | None = None
        # False only to measure what the agreement costs (the benchmark): without it, ranks
        # can take different skip decisions. Fixed at construction, the same on every rank.
        self.agree_with_peers = True
        self.agreements = 0  # found-inf all-reduces run (a host int, no sync)

    def _has_peers(self) -> bool:
        return dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _agree(self, found_inf_per_device: dict[Any, torch.Tensor]) -> None:
        """MAX-reduce each local found-inf flag in place, so any rank's inf is everyone's."""
        if not (self.agree_with_peers and self._has_peers()):
            return
        for flag in found_inf_per_device.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        self.agreements += 1

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self._enabled:
            self._agree(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        found_inf_per_device = super()._check_inf_per_device(optimizer)
        self._agree(found_inf_per_device)
        return found_inf_per_device

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self._enabled and self._scale is not None:
            flags = [flag.to(self._scale.device, non_blocking=True)
                     for state in self._per_optimizer_states.values()
                     for flag in state["found_inf_per_device"].values()]
            if flags:
                skipped = (torch.stack(flags).sum() > 0).to(torch.int64)
                self._last_skipped = skipped
                self._skipped_total = skipped if self._skipped_total is None else self._skipped_total + skipped
                streak = self.overflow_counters.record(skipped, self._scale, self.min_scale)
                if new_scale is None and self._growth_tracker is not None and self.hysteresis > 1:
                    new_scale, tracker = next_scale(
                        self._scale, self._growth_tracker, streak,
                        self._growth_factor, self._backoff_factor, self._growth_interval,
                        self.hysteresis, self.min_scale)
                    self._growth_tracker.copy_(tracker)
        floor = self._enabled and new_scale is None and self.min_scale > 0
        super().update(new_scale)
        if floor and self._scale is not None:
            # Without hysteresis, next_scale's rule is torch's own fused update (one kernel
            # instead of ~15 small ops, each a launch on a GPU) plus the floor: clamp after it.
            self._scale.clamp_(min=self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._enabled:
            state.update(self.overflow_counters.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._enabled:
            self.overflow_counters.load_state_dict(state_dict)

    def last_step_skipped(self) -> torch.Tensor:
        """0-d int tensor on the scaler's device: 1 if the last `update()` followed a skip."""
        if self._last_skipped is None:
            return torch.zeros((), dtype=torch.int64)
        return self._last_skipped

    def skipped_steps(self) -> torch.Tensor:
        """0-d int tensor: steps skipped since this scaler was made (read at logging time)."""
        if self._skipped_total is None:
            return torch.zeros((), dtype=torch.int64)
        return self._skipped_total

    def restore_skipped_steps(self, count: int) -> None:
        """Set the skipped-step counter, as a resumed run continues the count it saved."""
        device = self._scale.device if self._scale is not None else torch.device(self._device)
        self._skipped_total = torch.tensor(count, dtype=torch.int64, device=device)
