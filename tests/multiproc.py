"""Run test code in real processes: N gloo ranks of a function, or the CLI under torchrun.

`run_ranks(fn, world_size, *args)` spawns `world_size` fresh interpreters, each joins a
real gloo process group through ddp_amp's own env detection and init, calls
`fn(ctx, *args)` and returns what each rank returned (in rank order). `fn` must be a
module-level function of an importable module (spawn pickles it by name).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
               out_dir: str) -> None:
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    torch.set_num_threads(1)  # 2 cores shared by all ranks
    from ddp_amp.dist import init_distributed, shutdown_distributed
    from ddp_amp.env import detect_env

    ctx = init_distributed(detect_env(os.environ), device="cpu", timeout_s=60)
    try:
        result = fn(ctx, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        result = None  # free DDP objects before the group goes (see FACTS.md)
    finally:
        shutdown_distributed()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` real gloo ranks; return each rank's result."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [context.Process(target=_rank_main, args=(r, world_size, port, fn, args, out_dir))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for proc in alive:
            proc.kill()
            proc.join()
        if alive:
            raise TimeoutError(f"{len(alive)} rank(s) still running after {timeout}s")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RuntimeError(f"rank exit codes {codes}")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def cli_env(gpus: bool = False, **extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: this repo importable, no launcher variables.

    GPUs are hidden unless `gpus`: these tests pin the CPU path that CI runs, and on a
    machine with one GPU `--device auto` would otherwise put two ranks on it (an error).
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def run_train(args: list[str], nproc: int = 0, timeout: float = 180, torchrun_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m ddp_amp.train ARGS`, or under `torchrun --standalone` with `nproc` ranks."""
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", *torchrun_args, "-m", "ddp_amp.train", *args]
    else:
        command = [sys.executable, "-m", "ddp_amp.train", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=env or cli_env(), cwd=cwd or REPO_ROOT)
