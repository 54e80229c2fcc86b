"""Loss-scale safety for fp16: hysteresis, a floor, and a guard that stops a collapsing run.

Plain GradScaler halves the scale on every overflow and has no lower bound, so a run whose
gradients are genuinely non-finite (a diverged model, a bad batch every step) skips step
after step while the scale sinks towards zero, and the loss goes NaN much later. Here:

- *hysteresis* H (as DeepSpeed's): the first H - 1 consecutive overflowing steps are skipped
  but leave the scale alone; from the H-th on, every further overflow backs off. A clean
  step resets the count. H = 1 is GradScaler's own behaviour.
- *floor*: the scale never backs off below `min_scale`.
- `OverflowCounters`: on-device counts of consecutive skipped steps, and of consecutive
  skips that happened with the scale already at its floor. They are updated with tensor ops
  (no host sync) and read only when the guard checks.
- `LossScaleOptions`: the settings, validated with a hint.

The host-side check that turns those counts into a `TrainingHalted` lives with the other
guards (`ddp_amp.guards.loss_scale`).

Everything here runs on the scaler's device; the skip flags it consumes are the
rank-agreed ones, so every rank reaches the same decision without another collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddp_amp.errors import UsageError


def next_scale(scale: torch.Tensor, growth_tracker: torch.Tensor, streak: torch.Tensor,
               growth_factor: float, backoff_factor: float, growth_interval: int,
               hysteresis: int, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and growth tracker after a step, given the overflow `streak` *including* it.

    All tensor ops, so it never waits for the device. `streak` is 0 after a clean step.
    """
    found = streak > 0
    back_off = streak >= hysteresis
    # Any overflow, tolerated or not, restarts the count of clean steps towards growth
    # (GradScaler does the same): growth needs `growth_interval` clean steps in a row.
    tracker = torch.where(found, torch.zeros_like(growth_tracker), growth_tracker + 1)
    grow = tracker >= growth_interval
    grown = scale * growth_factor
    grown = torch.where(torch.isfinite(grown), grown, scale)  # never grow into inf
    backed = torch.clamp(scale * backoff_factor, min=min_scale)
    new_scale = torch.where(back_off, backed, torch.where(grow, grown, scale))
    tracker = torch.where(grow, torch.zeros_like(tracker), tracker)
    return new_scale, tracker


class OverflowCounters:
    """Consecutive-skip counts kept on the device; `worst()` reads and resets the maxima.

    The tensors are made on the first `record`, on the device of the scale itself (for
    "cuda" the scaler only learns which GPU from the first scaled loss).
    """

    def __init__(self) -> None:
        self.streak: torch.Tensor | None = None        # consecutive skipped steps, now
        self.floor_streak: torch.Tensor | None = None  # consecutive skips with the scale at its floor
        # Worst values since the last read: a guard that checks every k steps still sees a
        # streak that peaked and recovered between two checks.
        self._worst: torch.Tensor | None = None
        self._loaded = (0, 0)

    def _ensure(self, device: torch.device) -> None:
        if self.streak is None:
            self.streak = torch.tensor(self._loaded[0], dtype=torch.int64, device=device)
            self.floor_streak = torch.tensor(self._loaded[1], dtype=torch.int64, device=device)
            self._worst = torch.zeros(2, dtype=torch.int64, device=device)

    def record(self, skipped: torch.Tensor, scale_before: torch.Tensor, min_scale: float) -> torch.Tensor:
        """Count one step and return the skip streak including it (a device tensor).

        `skipped` is the agreed 0/1 flag, `scale_before` the scale the step used.
        """
        self._ensure(scale_before.device)
        skipped = skipped.to(scale_before.device, torch.int64)
        streak = (self.streak + 1) * skipped
        at_floor = (scale_before <= min_scale).to(torch.int64).reshape(()) if min_scale > 0 \
            else torch.zeros_like(skipped)
        floor_streak = (self.floor_streak + 1) * skipped * at_floor
        self.streak, self.floor_streak = streak, floor_streak
        self._worst = torch.maximum(self._worst, torch.stack([streak, floor_streak]))
        return streak

    def worst(self) -> tuple[int, int]:
        """(longest skip streak, longest at-floor skip streak) since the last call (host sync)."""
        if self._worst is None:
            return 0, 0
        streak, floor_streak = self._worst.tolist()
        self._worst.zero_()
        return int(streak), int(floor_streak)

    def state_dict(self) -> dict[str, int]:
        if self.streak is None:
            return {"overflow_streak": self._loaded[0], "floor_streak": self._loaded[1]}
        return {"overflow_streak": int(self.streak.item()), "floor_streak": int(self.floor_streak.item())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._loaded = (int(state.get("overflow_streak", 0)), int(state.get("floor_streak", 0)))
        if self.streak is not None:
            self.streak.fill_(self._loaded[0])
            self.floor_streak.fill_(self._loaded[1])


@dataclass(frozen=True)
class LossScaleOptions:
    """The fp16 loss-scale settings of a run (see the `--loss-scale-*` options)."""

    init_scale: float = 2.0**16
    growth_interval: int = 2000
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    hysteresis: int = 1
    max_consecutive_skips: int = 100

    def scaler_kwargs(self) -> dict[str, float | int]:
        """Keyword arguments for `AgreedGradScaler` / `Precision.make_scaler`."""
        return {"init_scale": self.init_scale, "growth_interval": self.growth_interval,
                "backoff_factor": self.backoff_factor, "min_scale": self.min_scale,
                "hysteresis": self.hysteresis}

    def validate(self) -> None:
        """Raise `UsageError` naming the bad option."""
        if not 0 < self.init_scale <= 2.0**64:  # also refuses nan; inf and past 2**64 overflow fp32 soon
            raise UsageError("--loss-scale-init", self.init_scale, "a number > 0 and at most 2**64",
                             "65536 is the usual start")
        if not 0 < self.backoff_factor < 1:
            raise UsageError("--loss-scale-backoff", self.backoff_factor, "a factor with 0 < f < 1", "e.g. 0.5")
        if not 0 <= self.min_scale <= self.init_scale:
            raise UsageError("--loss-scale-min", self.min_scale, f"0 <= floor <= --loss-scale-init "
                             f"({self.init_scale})", "0 turns the floor off; 1 is usual")
        for flag, value, least in (("--loss-scale-growth-interval", self.growth_interval, 1),
                                   ("--loss-scale-hysteresis", self.hysteresis, 1),
                                   ("--max-consecutive-skips", self.max_consecutive_skips, 0)):
            if not least <= value < 2**53:
                raise UsageError(flag, value, f"an integer from {least} to 2**53", f"e.g. {flag} {max(least, 1)}")
