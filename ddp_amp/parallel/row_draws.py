"""A random fill of one rank's rows of a parameter, equal to those rows of the full fill.

`uniform_` and `normal_` on a CPU tensor (torch 2.13) take values from the generator in
element order: `uniform_` one value per element; `normal_` a uniform value per element,
turned into normal ones 16 at a time, the last 16 elements drawn again where the count is
not a multiple of 16. So filling the flattened tensor piece by piece, each piece a multiple
of 16 elements and the last at least 16, gives the same values and leaves the generator
where one full fill leaves it. `fill_rows` does that through one scratch piece and keeps
the elements of this rank's rows: the full tensor is never held. `replay` makes the full
tensor again from the generator state the fill started from, for init code that goes on to
read it.

That equivalence is how torch's kernels work, not a promise of its API: `pieces_exact`
checks it once per process for each op and dtype, against a full fill on a private
generator (sizes past torch's parallel grain, so a kernel split over threads shows); where
it fails the caller fills the whole tensor instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

FILLS = frozenset({"uniform_", "normal_"})
PIECE = 1 << 20  # elements a piece holds (4 MiB of fp32): a multiple of 16
_CHECK_PIECE = 1 << 15  # torch's parallel grain (at::internal::GRAIN_SIZE)
_CHECK_SIZE = 3 * _CHECK_PIECE + 37  # several pieces and a short tail


def piece_bounds(numel: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """`[start, stop)` of each piece of `numel` elements: `piece` long (a multiple of 16),
    the last one at least 16 long (a shorter tail joins the piece before it)."""
    starts = list(range(0, numel, piece))
    if len(starts) > 1 and numel - starts[-1] < 16:
        starts.pop()
    return list(zip(starts, [*starts[1:], numel]))


def _generator(kwargs: dict[str, Any]) -> torch.Generator:
    chosen = kwargs.get("generator")
    return chosen if chosen is not None else torch.default_generator


def fill_rows(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], numel: int, dtype: torch.dtype,
              keep: list[tuple[int, int]], into: torch.Tensor, scratch: torch.Tensor,
              piece: int = PIECE) -> torch.Tensor:
    """Fill a tensor of `numel` elements with `func(tensor, *args, **kwargs)` piece by piece,
    copying the elements of the runs `keep` (`[start, stop)` of the flattened result, in
    order) one after the other into `into` (flat, contiguous); the generator state it started
    from, for `replay`. `scratch`: at least `piece + 15` elements of `dtype`, or `numel`."""
    start_state = _generator(kwargs).get_state()
    offsets = [0]
    for low, high in keep:
        offsets.append(offsets[-1] + high - low)
    run = 0  # the first run that may still meet a piece
    for start, stop in piece_bounds(numel, piece):
        part = scratch[:stop - start]
        func(part, *args, **kwargs)
        while run < len(keep) and keep[run][1] <= start:
            run += 1
        for index in range(run, len(keep)):
            low, high = keep[index]
            if low >= stop:
                break
            first, last = max(start, low), min(stop, high)
            into[offsets[index] + first - low:offsets[index] + last - low].copy_(part[first - start:last - start])
    return start_state


def replay(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], state: torch.Tensor | None,
           full: torch.Tensor) -> torch.Tensor:
    """The fill again, into `full` (the whole tensor): a random one from the generator state
    `state` it started from (the caller's generator is left where it is), or a constant one."""
    if state is None:
        func(full, *args, **kwargs)
        return full
    generator = torch.Generator()
    generator.set_state(state)
    func(full, *args, **{**kwargs, "generator": generator})
    return full


@functools.cache
def pieces_exact(func: Any, dtype: torch.dtype) -> bool:
    """Whether a piece-by-piece fill with `func` (an aten overload such as aten.normal_.default)
    equals a full one in `dtype` on this torch, values and generator state alike."""
    whole, pieces = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(1234)
    full = torch.empty(_CHECK_SIZE, dtype=dtype)
    func(full, generator=whole)
    kept = torch.empty(_CHECK_SIZE, dtype=dtype)
    scratch = torch.empty(_CHECK_PIECE + 15, dtype=dtype)
    fill_rows(func, (), {"generator": pieces}, _CHECK_SIZE, dtype, [(0, _CHECK_SIZE)], kept, scratch, _CHECK_PIECE)
    return torch.equal(full, kept) and torch.equal(whole.get_state(), pieces.get_state())
