"""How long a checkpoint save blocks training, against a bare torch.save.

    python -m ddp_amp.bench.checkpoint_stall [--hidden 1024 --layers 4 --repeats 7 --dir /tmp]

One process builds the real trainer (mlp task, AdamW, fp32) and, in alternating pairs so
that disk and CPU noise hit both alike, times (a) `Trainer.save_checkpoint()`: the whole
stall the loop sees (RNG gather, serialisation, fsyncs, sha256 manifest, rename, retention)
and (b) one `torch.save` of the same model + optimizer state to a file in the same
directory, no fsync. The ratio is the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddp_amp.config import TrainConfig
from ddp_amp.dist import init_distributed
from ddp_amp.env import DistEnv
from ddp_amp.trainer import Trainer, build_trainer


def _trainer(hidden: int, layers: int, root: Path, device: str) -> Trainer:
    config = TrainConfig(task="mlp", task_opt=(f"hidden={hidden}", f"layers={layers}", "samples=1024"),
                         batch_size=64, device=device, precision="fp32", keep_last=1, log_every=10**6)
    ctx = init_distributed(DistEnv(), device=device)  # type: ignore[arg-type]
    return build_trainer(config, ctx, checkpoint_root=root)


def run_checkpoint_bench(hidden: int = 1024, layers: int = 4, repeats: int = 7,
                         directory: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """Median save stall vs bare torch.save (seconds) and their paired ratio, as a dict."""
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        root = Path(scratch)
        trainer = _trainer(hidden, layers, root / "checkpoints", device)
        trainer.train_step()  # optimizer state exists from here on
        stalls, bares = [], []
        for _ in range(repeats):
            trainer.train_step()  # a new step, so save_checkpoint really writes
            started = time.perf_counter()
            path = trainer.save_checkpoint()
            stalls.append(time.perf_counter() - started)
            if path is None:
                raise RuntimeError(f"checkpoint save failed: {trainer.checkpoint_error}")
            started = time.perf_counter()
            torch.save({"model": trainer.autocast_model.unwrap().state_dict(),
                        "optimizer": trainer.optimizer.state_dict()}, root / "bare.pt")
            bares.append(time.perf_counter() - started)
        state_bytes = sum(p.stat().st_size for p in path.iterdir())
        ratios = [stall / bare for stall, bare in zip(stalls, bares)]
        return {
            "item": "checkpoint_save_stall",
            "device": str(trainer.device),
            "params": sum(p.numel() for p in trainer.params),
            "checkpoint_mb": state_bytes / 2**20,
            "repeats": repeats,
            "save_stall_s_median": statistics.median(stalls),
            "bare_torch_save_s_median": statistics.median(bares),
            "stall_over_bare_ratio": statistics.median(ratios),
            "save_mb_per_s": state_bytes / 2**20 / statistics.median(stalls),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_amp.bench.checkpoint_stall",
                                     description="checkpoint save stall vs a bare torch.save")
    parser.add_argument("--hidden", type=int, default=1024, help="mlp width (default 1024)")
    parser.add_argument("--layers", type=int, default=4, help="mlp depth (default 4)")
    parser.add_argument("--repeats", type=int, default=7, help="timed pairs (default 7)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    args = parser.parse_args(argv)
    print(json.dumps(run_checkpoint_bench(args.hidden, args.layers, args.repeats, args.dir, args.device),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
