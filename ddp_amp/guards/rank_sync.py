"""Rank-consistency guard: do all ranks still hold the same model, scaler state and step?

DDP keeps replicas identical only as long as every rank applies the same update. A rank
that skipped a step the others took, loaded a different checkpoint, or had its weights
changed outside DDP drifts apart for good, silently. `check_rank_sync` all-gathers a cheap
fingerprint of the parameters, the scaler state and the step, and stops with an error that
names the ranks that differ from rank 0 and the first parameters that differ.

The fingerprint per parameter is (sum, sum of squares) in float64: two small reductions per
tensor, a few hundred bytes to gather for a typical model. DDP replicas are bitwise equal,
so the comparison is exact. A sharded parameter (`--shard`) has one copy, split over the
ranks: there is nothing to compare, and it is left out (the step and the scaler still are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ddp_amp.amp import AgreedGradScaler
from ddp_amp.distributed import all_gather_objects
from ddp_amp.errors import TrainingHalted
from ddp_amp.torch_api import DTensor


@torch.no_grad()
def fingerprint(named_params: Sequence[tuple[str, nn.Parameter]], scaler: AgreedGradScaler | None,
                step: int) -> dict[str, Any]:
    """This rank's fingerprint: step, scaler state and per-parameter (sum, sum of squares)."""
    named_params = [(name, p) for name, p in named_params if not isinstance(p, DTensor)]  # replicated ones
    if named_params:
        flat = [p.detach().reshape(-1).double() for _, p in named_params]
        sums = torch.stack([t.sum() for t in flat])
        squares = torch.stack([t.dot(t) for t in flat])
        # float.hex: exact, and NaN compares equal to NaN (a model that is NaN everywhere
        # is diverged, not out of sync).
        values = [[x.hex() for x in pair] for pair in torch.stack([sums, squares], dim=1).cpu().tolist()]
    else:
        values = []
    scaler_state: tuple[float, ...] = ()
    if scaler is not None and scaler.is_enabled():
        state = scaler.state_dict()
        scaler_state = (float(state.get("scale", 0.0)), float(state.get("_growth_tracker", 0)),
                        float(scaler.skipped_steps().item()))
    return {"step": step, "scaler": scaler_state, "names": [n for n, _ in named_params],
            "params": values}


def _differences(mine: dict[str, Any], reference: dict[str, Any], max_names: int = 5) -> list[str]:
    found = []
    if mine["step"] != reference["step"]:
        found.append(f"step {mine['step']} vs {reference['step']}")
    if mine["scaler"] != reference["scaler"]:
        found.append(f"scaler (scale, growth tracker, skipped) {mine['scaler']} vs {reference['scaler']}")
    if mine["names"] != reference["names"]:
        found.append("parameter names/order")
        return found
    bad = [n for n, a, b in zip(mine["names"], mine["params"], reference["params"]) if a != b]
    if bad:
        more = f" (+{len(bad) - max_names} more)" if len(bad) > max_names else ""
        found.append("parameters " + ", ".join(bad[:max_names]) + more)
    return found


def check_rank_sync(named_params: Sequence[tuple[str, nn.Parameter]], scaler: AgreedGradScaler | None,
                    step: int, when: str = "") -> None:
    """Raise `TrainingHalted` on every rank if any rank's fingerprint differs from rank 0's.

    Collective: every rank must call it at the same point (all-gather of the fingerprints).
    Call it right after loading a checkpoint, and every `--check-sync-every` steps.
    """
    gathered = all_gather_objects(fingerprint(named_params, scaler, step))
    reference = gathered[0]
    problems = {}
    for rank, other in enumerate(gathered[1:], start=1):
        found = _differences(other, reference)
        if found:
            problems[rank] = found
    if problems:
        detail = "; ".join(f"rank {r} differs from rank 0 in {', '.join(f)}" for r, f in problems.items())
        raise TrainingHalted(
            f"ranks out of sync{' ' + when if when else ''} at step {step}: {detail}. "
            f"Ranks {sorted(problems)} no longer train the same model; nothing was checkpointed from "
            "this state. Resume from the last checkpoint; if it recurs, look for code that changes "
            "parameters or gradients outside DDP on some ranks only.")
