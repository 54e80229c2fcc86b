"""Save a Session checkpoint to one path again and again (run by tests, which kill it mid-save).

argv[1]: the checkpoint path; argv[2]: how many saves. Prints `saved N` after each one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ddp_amp import Session

path, count = Path(sys.argv[1]), int(sys.argv[2])
with Session("fp32", "cpu") as session:
    for n in range(1, count + 1):
        session.save(path, {"n": n, "weights": torch.full((4,), float(n))})
        print(f"saved {n}", flush=True)
