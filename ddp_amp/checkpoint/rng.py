"""Every rank's random-number state, captured for a checkpoint and put back on resume.

Each rank draws its own dropout and augmentation stream, so a checkpoint holds all of
them, one file per rank (`rng/rank-NNNNN.pt`), which each rank writes itself (rank_files.py)
and reads back alone: nothing a rank writes or reads for them grows with the number of
ranks. Checkpoints of an older layout hold them all in one `rng.pt` ({"ranks": [...]}),
which still resumes. On another number of ranks, rank r takes saved rank r's streams where
there was one, and keeps its own seeded streams where there was not.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

RNG_DIR = "rng"
LEGACY_RNG_FILE = "rng.pt"  # every rank's states in one file, as older checkpoints hold them


def rng_file(rank: int) -> str:
    """The checkpoint-relative name of rank `rank`'s RNG file."""
    return f"{RNG_DIR}/rank-{rank:05d}.pt"


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states, as tensors, ints and tuples only (weights_only-safe)."""
    # numpy's legacy state is a tuple with an ndarray; as a tensor plus ints it loads as
    # plain data without any allow-listing.
    legacy = np.random.get_state(legacy=True)
    if not isinstance(legacy, tuple):  # a dict only for a bit generator other than MT19937
        raise RuntimeError(f"numpy's global RNG is not MT19937: {legacy.get('bit_generator')}")
    _, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put this process's RNGs back to a state from `capture_rng`."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    saved = state["numpy"]
    np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["pos"],
                         saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
