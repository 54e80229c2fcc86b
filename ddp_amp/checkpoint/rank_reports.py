"""Rank 0's one gather of fixed-size records: what each rank reports of its part of a checkpoint.

A save ends, and each check of a checkpoint on resume ends, with every rank telling rank 0 one
thing: a 32-byte digest (the leaf of the record it wrote, or the fold of the leaves it checked;
rank_files.py) or why it could not. Each report is `REPORT_BYTES` long whatever the world
size: the digest, the reason's length, the reason in UTF-8 cut to fit. `gather_reports` sends
them in one `dist.gather` of a uint8 tensor (no pickling, and no all-gather of sizes first as
`gather_object` does), and rank 0 reads the N of them as one array: the XOR of the digests and
the first reason in rank order, in numpy, with no Python work per rank (16,384 ranks: 8 MiB).
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


def encode_report(digest: bytes, reason: str = "") -> bytes:
    """One rank's report: `digest` (32 bytes) and why it failed ("" where it did not)."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a report's digest is {DIGEST_BYTES} bytes, not {len(digest)}")
    text = reason.encode()[:_REASON_BYTES]
    return digest + len(text).to_bytes(2, "big") + text.ljust(_REASON_BYTES, b"\0")


@dataclass(frozen=True)
class Reports:
    """Every rank's report, in rank order, as rank 0 holds them after the gather."""

    table: np.ndarray  # (ranks, REPORT_BYTES), uint8

    @classmethod
    def of(cls, reports: Sequence[bytes]) -> Reports:
        """Reports from their encoded bytes (`encode_report`), rank 0's first."""
        return cls(np.frombuffer(b"".join(reports), dtype=np.uint8).reshape(len(reports), REPORT_BYTES))

    @property
    def count(self) -> int:
        return int(self.table.shape[0])

    def digest(self) -> bytes:
        """The XOR of every rank's digest."""
        return np.bitwise_xor.reduce(self.table[:, :DIGEST_BYTES], axis=0).tobytes()

    def first_failure(self) -> str | None:
        """The reason of the lowest rank that failed, or None where none did."""
        lengths = self.table[:, DIGEST_BYTES].astype(np.int64) * 256 + self.table[:, DIGEST_BYTES + 1]
        failed = np.flatnonzero(lengths)
        if failed.size == 0:
            return None
        row = int(failed[0])
        return self.table[row, _REASON_AT:_REASON_AT + int(lengths[row])].tobytes().decode(errors="replace")


def gather_reports(report: bytes, device: torch.device, group: dist.ProcessGroup | None = None) -> Reports | None:
    """Every rank's `report` on rank 0, in rank order; None on the other ranks (collective over
    `group`, the default group where None; the tensors live on `device`, as its backend wants)."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return Reports.of([report])
    mine = torch.frombuffer(bytearray(report), dtype=torch.uint8).to(device)
    rows = torch.empty((dist.get_world_size(group), REPORT_BYTES), dtype=torch.uint8, device=device) \
        if dist.get_rank() == 0 else None
    dist.gather(mine, list(rows.unbind(0)) if rows is not None else None, dst=0, group=group)
    return Reports(rows.cpu().numpy()) if rows is not None else None
