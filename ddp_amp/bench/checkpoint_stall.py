"""How long a checkpoint save blocks training: against a bare torch.save, and async against sync.

    python -m ddp_amp.bench.checkpoint_stall [--hidden 1024 --layers 4 --repeats 7 --dir /tmp]
    python -m ddp_amp.bench.checkpoint_stall --async-vs-sync [--hidden 4096 --layers 8 --repeats 5]
    python -m ddp_amp.bench --sections checkpoint --scale 1     # the second, as a bench section

One process builds the real trainer (mlp task, AdamW, fp32) and, in alternating pairs so
that disk and CPU noise hit both alike, times (a) `Trainer.save_checkpoint()`: the whole
stall the loop sees (each rank's own files, serialisation, fsyncs, sha256 manifest, rename, retention)
and (b) one `torch.save` of the same model + optimizer state to a file in the same
directory, no fsync. The ratio is the median of the per-pair ratios.

`--async-vs-sync` pairs (a) with `Trainer.start_checkpoint()`, the save `--async-checkpoint`
makes: the stall is the copy of the state into host memory and one broadcast; the write
runs in the background while the next step trains (that step's time is reported too, as
the writer thread shares the CPU with it). Its default size is the mlp at 101M parameters
(8 layers of width 4096; with AdamW's two moments a 1.2 GB checkpoint).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from collections.abc import Callable

import torch

from ddp_amp.bench.stats import paired_ratio
from ddp_amp.bench.table import grid, ratio_text
from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext, init_distributed
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.env import DistEnv
from ddp_amp.trainer import Trainer, build_trainer, session_for

# The async-vs-sync size: the mlp task's 8 layers of width 4096 hold 101M parameters.
ASYNC_HIDDEN, ASYNC_LAYERS = 4096, 8


def _trainer(hidden: int, layers: int, root: Path, device: str, async_checkpoint: bool = False) -> Trainer:
    config = TrainConfig(task="mlp", task_opt=(f"hidden={hidden}", f"layers={layers}", "samples=1024"),
                         batch_size=64, device=device, precision="fp32", keep_last=1, log_every=10**6,
                         # the bench calls the saves itself; a cadence is what the option requires
                         async_checkpoint=async_checkpoint, ckpt_every=10**6 if async_checkpoint else 0)
    return build_trainer(session_for(config).start(), config, checkpoint_root=root)


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
            saved = trainer.checkpoints.save(trainer.step, trainer.samples_seen)
            stalls.append(time.perf_counter() - started)
            if saved is None:
                raise RuntimeError("the synchronous checkpoint save wrote nothing (checkpointing is off)")
            path = saved
            started = time.perf_counter()
            torch.save({"model": trainer.session.unwrap(trainer.model).state_dict(),
                        "optimizer": trainer.optimizer.state_dict()}, root / "bare.pt")
            bares.append(time.perf_counter() - started)
        state_bytes = sum(p.stat().st_size for p in path.iterdir())
        trainer.session.close()  # retention's deletion ends before the folder is removed
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


def _timed(work: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """`work()`'s result and seconds; on CUDA the queue is drained before and after, so
    the time is `work`'s own and not the previous step's kernels'."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - started


def _committed(path: Path | None, trainer: Trainer) -> Path:
    if path is None:
        raise RuntimeError(f"checkpoint save failed: {trainer.checkpoints.error}")
    return path


def _async_pairs(ctx: DistContext, hidden: int, layers: int, pairs: int, directory: str | None) -> dict[str, Any]:
    """`pairs` rounds of one synchronous and one background save, the order flipping each round.

    Each save gets a fresh step (a step already saved is not written again). The background
    save's round also times the step that trains during its write, then waits for the commit.
    """
    device = ctx.device
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        trainer = _trainer(hidden, layers, Path(scratch) / "checkpoints", device.type, True)
        trainer.train_step()  # optimizer state exists from here on
        times: dict[str, list[float]] = {"sync": [], "async": [], "step": [], "step_writing": [], "to_commit": []}
        path = None
        for pair in range(pairs):
            for mode in ("sync", "async") if pair % 2 == 0 else ("async", "sync"):
                times["step"].append(_timed(trainer.train_step, device)[1])
                if mode == "sync":
                    path, seconds = _timed(lambda: trainer.checkpoints.save(trainer.step, trainer.samples_seen), device)
                    times["sync"].append(seconds)
                    _committed(path, trainer)
                    continue
                times["async"].append(_timed(lambda: trainer.checkpoints.save(trainer.step, trainer.samples_seen,
                                                                             background=True), device)[1])
                writing = _timed(trainer.train_step, device)[1]
                path, waited = _timed(trainer.checkpoints.wait, device)
                times["step_writing"].append(writing)
                times["to_commit"].append(writing + waited)
                _committed(path, trainer)
        state_bytes = sum(p.stat().st_size for p in _committed(path, trainer).iterdir())
        trainer.session.close()  # retention's deletion ends before the folder is removed
        median = {name: statistics.median(values) for name, values in times.items()}
        return {
            "item": "async_checkpoint_stall",
            "device": str(device),
            "params": sum(p.numel() for p in trainer.params),
            "checkpoint_mb": state_bytes / 2**20,
            "pairs": pairs,
            "sync_stall_s_median": median["sync"],
            "async_stall_s_median": median["async"],
            "async_over_sync_ratio_of_medians": median["async"] / median["sync"],
            "async_over_sync_paired": paired_ratio(times["sync"], times["async"]),
            "start_to_commit_s_median": median["to_commit"],
            "train_step_s_median": median["step"],
            "train_step_during_write_s_median": median["step_writing"],
        }


def run_async_bench(hidden: int = ASYNC_HIDDEN, layers: int = ASYNC_LAYERS, pairs: int = 5,
                    directory: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """Loop stall of a background save against a synchronous one, in this process."""
    return _async_pairs(init_distributed(DistEnv(), device=device), hidden, layers, pairs,
                        directory)


def run(device: str, scale: float, pairs: int, threads: int = 0, directory: str | None = None) -> dict[str, Any]:
    """`python -m ddp_amp.bench`'s checkpoint section: the width is 4096 x `scale`, in a fresh process."""
    hidden = max(16, round(ASYNC_HIDDEN * scale))
    result = run_ranks(_async_pairs, 1, hidden, ASYNC_LAYERS, pairs, directory, device=device, threads=threads,
                       timeout=3600)[0]
    return {"size": {"hidden": hidden, "layers": ASYNC_LAYERS, "batch": 64, "optimizer": "AdamW"}, **result}


def async_table(section: dict[str, Any]) -> str:
    """The checkpoint section as text."""
    size = section["size"]
    title = (f"Checkpoint stall: --async-checkpoint save vs synchronous save, mlp {size['layers']} layers of "
             f"width {size['hidden']} ({section['params'] / 1e6:.1f}M parameters, {size['optimizer']}, "
             f"{section['checkpoint_mb']:.0f} MB per checkpoint), {section['pairs']} paired saves")
    rows = [["synchronous save", section["sync_stall_s_median"], ""],
            ["background save: stall", section["async_stall_s_median"],
             ratio_text(section["async_over_sync_paired"])],
            ["background save: start to commit", section["start_to_commit_s_median"], ""],
            ["train step, no write", section["train_step_s_median"], ""],
            ["train step during the write", section["train_step_during_write_s_median"], ""]]
    return title + "\n" + grid(["", "median s", "async / sync (paired)"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_amp.bench.checkpoint_stall",
                                     description="checkpoint save stall vs a bare torch.save, or "
                                     "a background (--async-checkpoint) save vs a synchronous one")
    parser.add_argument("--async-vs-sync", action="store_true",
                        help="time a --async-checkpoint save against a synchronous one instead")
    parser.add_argument("--hidden", type=int, default=None, help="mlp width (default 1024; 4096 with --async-vs-sync)")
    parser.add_argument("--layers", type=int, default=None, help="mlp depth (default 4; 8 with --async-vs-sync)")
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs (default 7; 5 with --async-vs-sync)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    args = parser.parse_args(argv)
    if args.async_vs_sync:
        result = run_async_bench(args.hidden or ASYNC_HIDDEN, args.layers or ASYNC_LAYERS, args.repeats or 5,
                                 args.dir, args.device)
    else:
        result = run_checkpoint_bench(args.hidden or 1024, args.layers or 4, args.repeats or 7, args.dir, args.device)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
