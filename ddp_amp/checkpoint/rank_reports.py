"""What each rank reports of its part of a checkpoint, combined without a fan-in to one rank.

A save ends, and each check of a checkpoint on resume ends, with every rank telling the job
one thing: a 32-byte digest (the leaf of the record it wrote, or the fold of the leaves it
checked; rank_files.py) or why it could not. Each report is `REPORT_BYTES` long whatever the
world size: the digest, the reason's length, the reason in UTF-8 cut to fit. What the job
needs of them is as small: the XOR of the digests, and the reason of the lowest rank that
failed. `exchange_reports` gets exactly that with all-reduces, which NCCL and gloo run as
rings and trees, each rank talking to a few peers; a gather to rank 0 is N-1 point-to-point
receives on rank 0, for which NCCL opens a connection from rank 0 to every rank at the
first save and at the first resume (16,383 at 16,384 ranks), and so does a gloo group that
connects lazily (measured: docs/facts.md):
- one all-reduce (sum) of DIGEST_BYTES * 8 + 1 int32s: each bit of the rank's digest as 0 or
  1, and 1 where the rank failed; the XOR of the digests is each bit's sum's parity;
- only where a rank failed: an all-reduce (min) of the failed ranks, then a broadcast of
  that rank's reason from it.
EXCHANGE_BYTES (1,028) all-reduced whatever the world size, where the gather brought rank 0
8 MiB at 16,384 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

DIGEST_BYTES = 32
REPORT_BYTES = 512
_REASON_AT = DIGEST_BYTES + 2  # after the digest, the reason's length as two bytes, big-endian
_REASON_BYTES = REPORT_BYTES - _REASON_AT
_BITS = DIGEST_BYTES * 8
EXCHANGE_BYTES = (_BITS + 1) * 4  # the all-reduce every rank takes part in, whatever the world size


def encode_report(digest: bytes, reason: str = "") -> bytes:
    """One rank's report: `digest` (32 bytes) and why it failed ("" where it did not)."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a report's digest is {DIGEST_BYTES} bytes, not {len(digest)}")
    text = reason.encode()[:_REASON_BYTES]
    return digest + len(text).to_bytes(2, "big") + text.ljust(_REASON_BYTES, b"\0")


def _reason(report: bytes) -> str | None:
    size = int.from_bytes(report[DIGEST_BYTES:_REASON_AT], "big")
    return report[_REASON_AT:_REASON_AT + size].decode(errors="replace") if size else None


@dataclass(frozen=True)
class Reports:
    """What rank 0 holds of every rank's report once they are combined: how many ranks
    reported, the XOR of their digests, and the lowest failed rank's reason (None: none failed)."""

    count: int
    xor: bytes
    failure: str | None

    @classmethod
    def of(cls, reports: Sequence[bytes]) -> Reports:
        """The combination of reports given as their encoded bytes (`encode_report`), rank 0's
        first: what `exchange_reports` hands rank 0."""
        table = np.frombuffer(b"".join(reports), dtype=np.uint8).reshape(len(reports), REPORT_BYTES)
        lengths = table[:, DIGEST_BYTES].astype(np.int64) * 256 + table[:, DIGEST_BYTES + 1]
        failed = np.flatnonzero(lengths)
        return cls(len(reports), np.bitwise_xor.reduce(table[:, :DIGEST_BYTES], axis=0).tobytes(),
                   _reason(reports[int(failed[0])]) if failed.size else None)

    def digest(self) -> bytes:
        """The XOR of every rank's digest."""
        return self.xor

    def first_failure(self) -> str | None:
        """The reason of the lowest rank that failed, or None where none did."""
        return self.failure


def exchange_reports(report: bytes, device: torch.device, group: dist.ProcessGroup | None = None) -> Reports | None:
    """Every rank's `report` combined, on rank 0; None on the other ranks (collective over
    `group`, the default group where None; the tensors live on `device`, as its backend
    wants). No rank receives more than a few KiB, and none from more than a few peers."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return Reports.of([report])
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = _reason(report)
    bits = np.unpackbits(np.frombuffer(report[:DIGEST_BYTES], dtype=np.uint8)).astype(np.int32)
    sums = torch.from_numpy(np.append(bits, np.int32(reason is not None))).to(device)
    dist.all_reduce(sums, group=group)
    totals = sums.cpu().numpy()
    failure = None
    if totals[_BITS]:  # some rank failed: the lowest one's reason, from it
        first = torch.tensor([rank if reason is not None else size], dtype=torch.int32, device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        source = int(first.item())
        text = torch.frombuffer(bytearray(report[DIGEST_BYTES:]), dtype=torch.uint8).to(device)
        dist.broadcast(text, src=dist.get_global_rank(group, source) if group is not None else source, group=group)
        failure = _reason(bytes(DIGEST_BYTES) + text.cpu().numpy().tobytes())
    if rank != 0:
        return None
    return Reports(size, np.packbits((totals[:_BITS] % 2).astype(np.uint8)).tobytes(), failure)
