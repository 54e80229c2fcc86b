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

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from ddp_amp.amp.lossscale import OverflowCounters, next_scale


class ScalerOptions(TypedDict, total=False):
    """`AgreedGradScaler`'s tunable keyword arguments."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float


_FLOAT_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "min_scale")
_INT_OPTIONS = ("growth_interval", "hysteresis")


def scaler_options_of(given: Mapping[str, float | int]) -> ScalerOptions:
    """`given` (say `LossScaleOptions.scaler_kwargs()`) as typed `AgreedGradScaler` options;
    TypeError names an option the scaler does not have."""
    unknown = sorted(set(given) - set(_FLOAT_OPTIONS) - set(_INT_OPTIONS))
    if unknown:
        raise TypeError(f"AgreedGradScaler has no option {', '.join(map(repr, unknown))}")
    options = ScalerOptions()
    if "init_scale" in given:
        options["init_scale"] = float(given["init_scale"])
    if "growth_factor" in given:
        options["growth_factor"] = float(given["growth_factor"])
    if "backoff_factor" in given:
        options["backoff_factor"] = float(given["backoff_factor"])
    if "min_scale" in given:
        options["min_scale"] = float(given["min_scale"])
    if "growth_interval" in given:
        options["growth_interval"] = int(given["growth_interval"])
    if "hysteresis" in given:
        options["hysteresis"] = int(given["hysteresis"])
    return options


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
        # device-to-host sync on CUDA. Per step the scaler only records the agreed flag.
        self._last_skipped: torch.Tensor | None = None
        self._no_skip: torch.Tensor | None = None  # what last_step_skipped() says before any step
        # False only to measure what the agreement costs (the benchmark): without it, ranks
        # can take different skip decisions. Fixed at construction, the same on every rank.
        self.agree_with_peers = True
        self.agreements = 0  # found-inf all-reduces run (a host int, no sync)
        self._peers_of: object = None
        self._peers = False
        # Per optimizer step function: does it take the old `grad_scaler` keyword? torch's
        # `step` asks `inspect.signature` on every step, host time a fused step need not pay
        # (docs/facts.md, "Host time on the hot path").
        self._takes_scaler_kwarg: dict[Callable[..., Any], bool] = {}
        self._unit: torch.Tensor | None = None  # the 1.0 "inverse scale" of the inf check, made once

    def _has_peers(self) -> bool:
        # Asked once per step; the answer holds for the life of the process group, so it is
        # kept, per group object (a test may make a new group in the same process).
        group = self.process_group if self.process_group is not None else \
            (dist.group.WORLD if dist.is_initialized() else None)
        if self._peers_of is not group or group is None:
            self._peers_of = group
            self._peers = group is not None and dist.get_world_size(group) > 1
        return self._peers

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
        # torch's own, but with the unit "inverse scale" made once instead of every step.
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        if self._unit is None or self._unit.device != scale.device:
            self._unit = torch.ones((), dtype=torch.float32, device=scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)  # fresh: kept by reference
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._unit, found_inf, True)
        self._agree(state["found_inf_per_device"])
        return state["found_inf_per_device"]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """torch's `step`; for optimizers that unscale in their own kernel (fused), without
        its per-step host work: the signature lookup, and the copies of flag and scale."""
        if not self._enabled or "closure" in kwargs or not getattr(optimizer, "_step_supports_amp_scaling", False) \
                or self._wants_scaler_kwarg(optimizer):
            return super().step(optimizer, *args, **kwargs)
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        flags = list(state["found_inf_per_device"].values())
        # The optimizer only reads the flag and the scale, so it gets them as they are;
        # torch hands it copies (`0 + flag` and `scale * 1`), two ops per step.
        found_inf = flags[0] if len(flags) == 1 and flags[0].device == scale.device else \
            sum(flag.to(scale.device, non_blocking=True) for flag in flags)
        earlier = getattr(optimizer, "grad_scale", None)  # a scale the user set on the optimizer
        if state["stage"] is OptState.UNSCALED:
            grad_scale = earlier  # unscale_ already divided the gradients
        else:
            grad_scale = scale if earlier is None else scale * earlier
        optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]  # fused-step protocol, as torch does
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]  # set just above
        state["stage"] = OptState.STEPPED
        return result

    def _wants_scaler_kwarg(self, optimizer: torch.optim.Optimizer) -> bool:
        step = getattr(optimizer.step, "__func__", optimizer.step)
        wants = self._takes_scaler_kwarg.get(step)
        if wants is None:
            wants = self._takes_scaler_kwarg[step] = "grad_scaler" in inspect.signature(optimizer.step).parameters
        return wants

    def skip_together(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """One skip decision for several unscaled optimizers: an inf in any one's gradients
        skips them all (device ops only; call after `unscale_` of each, before `step`)."""
        if not self._enabled or len(optimizers) < 2:
            return
        flags = [flag for optimizer in optimizers
                 for flag in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()]
        combined = torch.stack([flag.to(flags[0].device) for flag in flags]).amax()
        for flag in flags:  # in place: step() and fused optimizers read these very tensors
            flag.copy_(combined)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self._enabled and self._scale is not None:
            flags = [flag for state in self._per_optimizer_states.values()
                     for flag in state["found_inf_per_device"].values()]
            if flags:
                # One optimizer on one device (the usual case) hands its agreed flag over
                # as it is: no op. Several are combined on the scale's device.
                skipped = flags[0] if len(flags) == 1 else \
                    (torch.stack([f.to(self._scale.device) for f in flags]).sum() > 0).float()
                self._last_skipped = skipped
                floored = self.min_scale > 0
                self.overflow_counters.record(skipped, self._scale.clone() if floored else None, self.min_scale)
                if new_scale is None and self._growth_tracker is not None and self.hysteresis > 1:
                    new_scale, tracker = next_scale(
                        self._scale, self._growth_tracker, self.overflow_counters.current_streak(self._scale.device),
                        self._growth_factor, self._backoff_factor, self._growth_interval,
                        self.hysteresis, self.min_scale)
                    self._growth_tracker.copy_(tracker)
        floor = self._enabled and new_scale is None and self.min_scale > 0
        super().update(new_scale)
        if floor and self._scale is not None:
            # Without hysteresis, next_scale's rule is torch's own fused update (one kernel
            # instead of next_scale's chain of small ops, each a launch on a GPU) plus the
            # floor: clamp after it.
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
        """0-d float tensor on the scaler's device: 1 if the last `update()` followed a skip, else 0.

        The agreed found-inf flag itself, not a copy (the scaler makes a new one each step).
        """
        if self._last_skipped is None:
            if self._no_skip is None:
                self._no_skip = torch.zeros(())
            return self._no_skip
        return self._last_skipped

    def skipped_steps(self) -> torch.Tensor:
        """0-d int tensor: steps skipped since this scaler was made (read at logging time)."""
        scale = getattr(self, "_scale", None)  # a disabled scaler has none
        device = scale.device if scale is not None else torch.device("cpu")
        return self.overflow_counters.skipped_total(device)

    def restore_skipped_steps(self, count: int) -> None:
        """Set the skipped-step counter, as a resumed run continues the count it saved."""
        self.overflow_counters.restore_total(count)
