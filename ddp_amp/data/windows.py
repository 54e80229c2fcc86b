"""Training items cut from a tokenized split: windows of `seq + 1` tokens.

An item is `{"input_ids", "labels", "position_ids"}` of `seq` tokens each: labels are the
next tokens (-100 where the loss does not look), positions count from 0 (and restart at each
document where boundaries are kept).

- `WrappedWindows` (packing `wrapped`): documents end to end, cut into consecutive windows of
  seq + 1 tokens, the remainder dropped: run_clm.py's `group_texts` with block size seq + 1,
  where its texts end in the EOS and all rows are grouped in one batch (docs/data.md).
  Window i is tokens [i (seq + 1), (i + 1)(seq + 1)): nothing is indexed, whatever the size.
  Of masked documents (conversations, completions), a window with no target is dropped
  (`trained_windows` finds the others, once: a plan, plan_store.py).
- `PackedWindows` (packing `bfd`): whole documents placed into windows by best-fit decreasing
  (packing.py), the rest of a window padded; boundaries are always kept.

With boundaries kept, positions restart at 0 where a document starts (a window that starts
inside a document starts its positions at 0 too), no label is the first token of another
document, and padding is a segment of its own with no labels. Models whose attention reads
restarting `position_ids` as separate sequences (transformers' masks for packed sequences,
with SDPA, eager or flash attention) then attend within each document only.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_amp.data.packing import PackPlan
from ddp_amp.data.plan_store import PlanArrays
from ddp_amp.data.token_store import TokenSplit

IGNORE = -100  # the label cross-entropy skips (torch's ignore_index default)


def window_item(tokens: np.ndarray, mask: np.ndarray | None, starts: np.ndarray | None, seq: int,
                pad_id: int) -> dict[str, torch.Tensor]:
    """One item from up to seq + 1 tokens (padded after `len(tokens)`); `mask`: 1 where a token
    may be a target; `starts`: where documents start in `tokens` (None: boundaries not kept)."""
    length = len(tokens)
    ids = np.full(seq + 1, pad_id, dtype=np.int64)
    ids[:length] = tokens
    labels = ids[1:].copy()
    targets = np.zeros(seq, dtype=bool)  # which labels the loss may look at
    targets[:length - 1] = True if mask is None else np.asarray(mask[1:length]) != 0
    labels[~targets] = IGNORE  # padding, and what the mask leaves out
    positions = np.arange(seq, dtype=np.int64)
    if starts is not None:
        inside = starts[(starts > 0) & (starts <= seq)]
        labels[inside - 1] = IGNORE  # no document predicts the next one's first token
        cuts = np.concatenate([[0], inside[inside < seq], [length] if length < seq else []]).astype(np.int64)
        positions -= cuts[np.searchsorted(cuts, positions, side="right") - 1]
    # Positions always, so that windows with and without boundaries mix in one batch.
    return {"input_ids": torch.from_numpy(ids[:-1].copy()), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions)}


def trained_windows(split: TokenSplit, seq: int, boundaries: bool) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Which of the split's wrapped windows hold a target (a label the loss looks at): a plan's
    arrays (`kept`: their indices, empty where every window does) and facts (`windows`, and
    `untrained`: how many do not). One pass over the mask."""
    capacity = seq + 1
    count = split.tokens // capacity
    lows = np.arange(count, dtype=np.int64) * capacity
    # A window's first token is no label; with boundaries, neither is a document's first token.
    held = split.targets_in(lows + 1, lows + capacity, skip_starts=boundaries) > 0
    untrained = count - int(held.sum())
    kept = np.flatnonzero(held) if untrained else np.zeros(0, np.int64)
    return {"kept": kept.astype(np.uint64)}, {"windows": count, "untrained": untrained}


class WrappedWindows(Dataset):
    """Consecutive windows of a split's token stream (`group_texts`), with or without boundaries;
    `plan`: where only some windows are used, `trained_windows`' arrays (None: all of them)."""

    def __init__(self, split: TokenSplit, seq: int, boundaries: bool, pad_id: int,
                 plan: PlanArrays | None = None) -> None:
        self.split, self.seq, self.boundaries, self.pad_id, self.plan = split, seq, boundaries, pad_id, plan
        self.count = split.tokens // (seq + 1) if plan is None else len(plan["kept"])

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        if self.plan is not None:
            index = int(self.plan["kept"][index])
        start = index * (self.seq + 1)
        stop = start + self.seq + 1
        starts = self.split.document_starts(start, stop) - start if self.boundaries else None
        return window_item(np.asarray(self.split.token_slice(start, stop)), self.split.mask_slice(start, stop),
                           starts, self.seq, self.pad_id)


class PackedWindows(Dataset):
    """Whole documents packed into windows by a `PackPlan`; boundaries always kept."""

    def __init__(self, split: TokenSplit, plan: PackPlan, seq: int, pad_id: int) -> None:
        self.split, self.plan, self.seq, self.pad_id = split, plan, seq, pad_id

    def __len__(self) -> int:
        return self.plan.windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.plan.windows:
            raise IndexError(index)
        pieces, masks, starts = [], [], [0]
        offsets = self.split.offsets
        for document in self.plan.documents_of(index):
            start, stop = int(offsets[document]), int(offsets[document + 1])
            start, stop = self.plan.kept(start, stop)
            pieces.append(np.asarray(self.split.token_slice(start, stop)))
            mask = self.split.mask_slice(start, stop)
            if mask is not None:
                masks.append(np.asarray(mask))
            starts.append(starts[-1] + stop - start)
        tokens = np.concatenate(pieces)
        return window_item(tokens, np.concatenate(masks) if masks else None, np.asarray(starts[:-1]),
                           self.seq, self.pad_id)

