"""A `.safetensors` file read with plain reads (`os.pread`), never mapped.

The format (safetensors' own specification): 8 bytes, a little-endian unsigned length N;
N bytes of JSON mapping each tensor's name to its `dtype`, `shape` and `data_offsets`
(begin and end, from the first byte after the header), and an optional `__metadata__`;
then the tensors' bytes, row-major, little-endian.

Why not safetensors' own reader: it maps the file, and every page of it a rank touches
counts in that rank's resident set (VmRSS, VmHWM) until the mapping goes, although the
pages are the kernel's file cache and no private memory of the rank's. A rank loading its
1/N of a sharded model then showed a peak resident set of about twice its share, which is
what a Slurm MaxRSS or a memory limit that reads RSS sees (docs/facts.md). Read into a
buffer of its own, a rank's resident set holds the slice it asked for and no more.

Cost: a rank reads exactly the bytes of its slice: one read for a slice of rows (what a
data-parallel shard or a `colwise` split holds), one per row for a slice of columns (a
`rowwise` split's).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# The first bytes of what torch.save writes: a zip archive (torch >= 1.6), or a bare pickle.
TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")
_HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on the JSON header


class NotSafetensors(ValueError):
    """The file is not a complete, readable .safetensors file; the message says why."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in its file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int



def read_header(path: Path) -> dict[str, StoredTensor]:
    """Each tensor of the file at `path`, checked against the file's size (so a truncated file
    is refused here, before anything is loaded); NotSafetensors where it is not one."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        start = file.read(8)
        if start.startswith(TORCH_SAVE_MAGIC):
            raise NotSafetensors("it is a PyTorch pickle (torch.save, pytorch_model.bin), not safetensors")
        if len(start) < 8:
            raise NotSafetensors(f"{size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", start)
        if length > min(_HEADER_LIMIT, size - 8):
            raise NotSafetensors(f"its header claims {length} bytes of a {size}-byte file")
        try:
            header = json.loads(file.read(length))
        except ValueError as error:
            raise NotSafetensors(f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise NotSafetensors("its header is not a JSON object")
    data_start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(dim) for dim in entry["shape"])
            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise NotSafetensors(f"tensor {name!r}: dtype, shape or data_offsets missing or unknown "
                                 f"({str(entry)[:80]})") from None
        elements = 1
        for dim in shape:
            elements *= dim
        if end - begin != elements * dtype.itemsize or begin < 0:
            raise NotSafetensors(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {entry['dtype']}")
        if data_start + end > size:
            raise NotSafetensors(f"tensor {name!r} ends at byte {data_start + end} of a {size}-byte file "
                                 "(truncated)")
        tensors[name] = StoredTensor(dtype, shape, data_start + begin, data_start + end)
    return tensors


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` with the bytes at `offset` (a read may return fewer: it is repeated)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise NotSafetensors(f"the file ended at byte {offset + done}, {len(view) - done} bytes early")
        done += got


def read_slice(fd: int, stored: StoredTensor, region: tuple[slice, ...] | None = None) -> torch.Tensor:
    """The tensor, or its `region` (one slice per dimension, steps of 1), from the open file
    `fd`: only the region's bytes are read, in one read per contiguous run of them (one for
    rows; one per row for a slice of columns)."""
    shape = stored.shape
    region = tuple(region or ()) + tuple(slice(0, size) for size in shape[len(region or ()):])
    sizes = [max(0, cut.stop - cut.start) for cut in region]
    item = stored.dtype.itemsize
    buffer = bytearray(math.prod(sizes) * item)
    if buffer:
        # The last dimension the region cuts: past it, every run is contiguous in the file.
        cut = max((dim for dim in range(len(shape)) if sizes[dim] != shape[dim]), default=0)
        run = math.prod(sizes[cut:]) * item
        strides = [math.prod(shape[dim + 1:]) * item for dim in range(len(shape))]
        view = memoryview(buffer)
        for index, starts in enumerate(itertools.product(*(range(r.start, r.stop) for r in region[:cut]))):
            offset = stored.begin + sum(start * stride for start, stride in zip(starts, strides))
            offset += region[cut].start * strides[cut] if shape else 0
            _pread_into(fd, view[index * run:(index + 1) * run], offset)
    if not buffer:
        return torch.empty(sizes, dtype=stored.dtype)
    return torch.frombuffer(buffer, dtype=stored.dtype).reshape(sizes)
