"""Interleaved timing and paired ratios: how two contenders are compared on a noisy machine.

Per-step times of the same 2-rank job vary from run to run by more than the differences
measured here (docs/facts.md, "Timing noise, and what a collective costs"), so
contenders run in alternating blocks of steps inside one run (A B, B A, A B, ...: the order
flips every round), each block timed on its own, and each round's A block is paired with
its B block. The median of
the paired ratios, with its quartiles and extremes, is the figure: slow drift of the machine
hits both halves of a pair alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def interleave(contenders: Sequence[Callable[[], object]], blocks: int, steps: int,
               device: torch.device) -> list[list[float]]:
    """Run `blocks` rounds of `steps` steps of each contender in turn; seconds per step per block.

    Collective when a process group exists (a barrier before each block aligns the ranks,
    outside the timed region): call it on every rank with the same arguments.
    """
    times: list[list[float]] = [[] for _ in contenders]
    order = list(range(len(contenders)))
    for block in range(blocks):
        # Every other round runs the contenders in reverse (A B, B A, ...), so a position
        # effect (caches, the peer rank arriving late after the barrier) hits both alike.
        for index in order if block % 2 == 0 else order[::-1]:
            step = contenders[index]
            _barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[index].append((time.perf_counter() - started) / steps)
    return times


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of `values` (q in [0, 1])."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Median of the per-block ratios b/a with its spread (quartiles, min, max) and n."""
    ratios = [tb / ta for ta, tb in zip(a, b) if ta > 0]
    if not ratios:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"),
                "min": float("nan"), "max": float("nan"), "pairs": 0}
    return {"median": statistics.median(ratios), "q1": quantile(ratios, 0.25),
            "q3": quantile(ratios, 0.75), "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}


def median_ms(times: Sequence[float]) -> float:
    """Median per-step time in milliseconds."""
    return 1e3 * statistics.median(times) if times else float("nan")
