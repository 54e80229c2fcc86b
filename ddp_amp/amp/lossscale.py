"""Loss-scale safety for fp16: hysteresis, a floor, and a guard that stops a collapsing run.

Plain GradScaler halves the scale on every overflow and has no lower bound, so a run whose
gradients are genuinely non-finite (a diverged model, a bad batch every step) skips step
after step while the scale sinks towards zero, and the loss goes NaN much later. Here:

- *hysteresis* H (as DeepSpeed's): the first H - 1 consecutive overflowing steps are skipped
  but leave the scale alone; from the H-th on, every further overflow backs off. A clean
  step resets the count. H = 1 is GradScaler's own behaviour.
- *floor*: the scale never backs off below `min_scale`.
- `OverflowCounters`: on-device counts of skipped steps, consecutive skipped steps, and
  consecutive skips that happened with the scale already at its floor. A step only appends
  its flag to a list; the counts are folded from it with a few vectorized device ops every
  `FOLD_EVERY` steps or when read (no host sync), and read only when the guard checks.
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


FOLD_EVERY = 1024  # steps between folds of the recorded flags: bounds the list, amortizes the ops


def _runs_of_ones(flags: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
    """For 0/1 `flags` (n,), the length of the run of ones ending at each position, where
    the run before the first flag was `carried` long (all device ops, no host sync)."""
    index = torch.arange(flags.numel(), device=flags.device)
    last_zero = torch.cummax(torch.where(flags == 0, index, -1), dim=0).values
    return index - last_zero + (last_zero < 0).to(index.dtype) * carried


class OverflowCounters:
    """Skipped-step counts kept on the device and folded lazily: nothing per step but a list append.

    `record(flag, scale_before)` keeps a reference to the step's agreed skip flag (and, with
    a floor set, a copy of the scale the step used). Every `FOLD_EVERY` steps, and whenever
    someone reads the counts, `fold()` turns the recorded steps into the running total, the
    current streaks and the worst streaks since the last `worst()`, with a few vectorized
    ops on the device (a cumulative max finds the runs of skips), no host sync.

    Counts: skipped steps in total; consecutive skipped steps (`streak`); consecutive skips
    with the scale already at its floor (`floor_streak`). The tensors are made on the first
    fold, on the device of the flags (for "cuda" the scaler only learns which GPU from the
    first scaled loss).
    """

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []
        self._min_scale = 0.0
        self.total: torch.Tensor | None = None
        self.streak: torch.Tensor | None = None
        self.floor_streak: torch.Tensor | None = None
        # Worst values since the last read: a guard that checks every k steps still sees a
        # streak that peaked and recovered between two checks.
        self._worst: torch.Tensor | None = None
        self._loaded = (0, 0, 0)  # total, streak, floor streak from a checkpoint

    def record(self, skipped: torch.Tensor, scale_before: torch.Tensor | None, min_scale: float) -> None:
        """Count one step: `skipped` is its agreed 0/1 flag, `scale_before` the scale it used
        (a tensor the caller will not change; only needed with a floor, `min_scale` > 0)."""
        self._flags.append(skipped)
        self._min_scale = min_scale
        if min_scale > 0 and scale_before is not None:
            self._scales.append(scale_before)
        if len(self._flags) >= FOLD_EVERY:
            self.fold()

    def _ensure(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The counts (total, streak, floor streak, worst) on `device`, made on first use."""
        if self.total is None or self.streak is None or self.floor_streak is None or self._worst is None:
            total, streak, floor_streak = self._loaded
            counts = (torch.tensor(total, dtype=torch.int64, device=device),
                      torch.tensor(streak, dtype=torch.int64, device=device),
                      torch.tensor(floor_streak, dtype=torch.int64, device=device),
                      torch.zeros(2, dtype=torch.int64, device=device))
        elif self.total.device != device:  # read before the first step
            counts = (self.total.to(device), self.streak.to(device), self.floor_streak.to(device),
                      self._worst.to(device))
        else:
            counts = (self.total, self.streak, self.floor_streak, self._worst)
        self.total, self.streak, self.floor_streak, self._worst = counts
        return counts

    def fold(self) -> None:
        """Fold the steps recorded since the last fold into the counts (device ops only)."""
        if not self._flags:
            return
        device = self._flags[0].device
        total, streak, floor_streak, worst = self._ensure(device)
        flags = torch.stack(self._flags).to(device, torch.int64).reshape(-1)
        runs = _runs_of_ones(flags, streak)
        if self._scales and len(self._scales) == len(self._flags):
            at_floor = (torch.stack(self._scales).reshape(-1).to(device) <= self._min_scale).to(torch.int64)
            floor_runs = _runs_of_ones(flags * at_floor, floor_streak)
        else:
            floor_runs = torch.zeros_like(runs)
        self.total = total + flags.sum()
        self.streak, self.floor_streak = runs[-1], floor_runs[-1]
        self._worst = torch.maximum(worst, torch.stack([runs.max(), floor_runs.max()]))
        self._flags, self._scales = [], []

    def skipped_total(self, device: torch.device) -> torch.Tensor:
        """0-d int tensor: skipped steps so far (folds; no host sync)."""
        self.fold()
        return self._ensure(device)[0]

    def current_streak(self, device: torch.device) -> torch.Tensor:
        """0-d int tensor: consecutive skipped steps up to the last recorded one (folds)."""
        self.fold()
        return self._ensure(device)[1]

    def restore_total(self, count: int) -> None:
        """Set the skipped-step total, as a resumed run continues the count it saved."""
        self.fold()
        if self.total is None:
            self._loaded = (count, *self._loaded[1:])
        else:
            self.total.fill_(count)

    def worst(self) -> tuple[int, int]:
        """(longest skip streak, longest at-floor skip streak) since the last call (host sync)."""
        self.fold()
        if self._worst is None:
            return 0, 0
        streak, floor_streak = self._worst.tolist()
        self._worst.zero_()
        return int(streak), int(floor_streak)

    def state_dict(self) -> dict[str, int]:
        self.fold()
        if self.streak is None or self.floor_streak is None:
            return {"overflow_streak": self._loaded[1], "floor_streak": self._loaded[2]}
        return {"overflow_streak": int(self.streak.item()), "floor_streak": int(self.floor_streak.item())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.fold()
        streaks = (int(state.get("overflow_streak", 0)), int(state.get("floor_streak", 0)))
        self._loaded = (self._loaded[0], *streaks)
        if self.streak is not None and self.floor_streak is not None:
            self.streak = torch.full_like(self.streak, streaks[0])
            self.floor_streak = torch.full_like(self.floor_streak, streaks[1])


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
