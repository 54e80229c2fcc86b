"""Host tensors in memory mappings of their own, given back to the system when freed.

A sharded build (`meta_init`) holds each parameter's rows until the sharded model has
storage for them, and now and then one parameter in full. Allocated by malloc, as torch's
CPU tensors are, the memory of the ones freed stays with the process: glibc serves
allocations below its mmap threshold (which rises, up to 32 MiB, each time a mapped block
is freed) from its heap and keeps what is freed there for reuse, and the rows freed one by
one while the shards are allocated a little larger (padded) leave holes that neither fit
nor go back. On a 276M-parameter Llama sharded over 4 ranks that took a rank's peak from
1.15 x its share after the build to between 1.22 x and 1.90 x after `materialize`, a
different rank each run (docs/benchmarks.md). A tensor here has its own anonymous mapping,
unmapped when the last tensor viewing it is freed: the peak is what is held, whatever the
allocator does, and no environment variable needs setting.
"""

from __future__ import annotations

import math
import mmap
import warnings

import torch

MAPPED_FROM = 1 << 20  # bytes: a smaller tensor comes from malloc as usual (pages are 4 KiB)


def mapped_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, in its own memory mapping where it is large."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MAPPED_FROM:
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)
    with warnings.catch_warnings():  # "the buffer is not writable": it is (an anonymous mapping)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


def mapped_copy(source: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `source` (on the CPU), in its own mapping where it is large."""
    copy = mapped_empty(source.shape, source.dtype)
    copy.copy_(source)
    return copy
