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
# Private, not Python's default shared mapping: shared anonymous memory is the kernel's shmem,
# whose pages are allocated by a read too (copying 1 GiB out of an untouched shared mapping
# took 1.6 s and 1 GiB of resident memory, out of a private one 0.27 s and none: its
# untouched pages read as the one zero page). Where the flags do not exist (Windows), the default.
_PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}


def mapped_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, in its own memory mapping where it is large."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MAPPED_FROM:
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, **_PRIVATE)
    with warnings.catch_warnings():  # "the buffer is not writable": it is (an anonymous mapping)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


def mapped_zeros(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`mapped_empty`'s tensor, zeros: a new mapping is zeros already, its pages untouched until written."""
    numel = math.prod(shape)
    if numel * torch.empty((), dtype=dtype).element_size() < MAPPED_FROM:
        return torch.zeros(shape, dtype=dtype)
    return mapped_empty(shape, dtype)


def mapped_copy(source: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `source` (on the CPU), in its own mapping where it is large."""
    copy = mapped_empty(source.shape, source.dtype)
    copy.copy_(source)
    return copy
