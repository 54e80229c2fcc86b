"""Fresh processes for the benchmark: one per trial (so memory peaks don't carry over) or N ranks.

Functions passed here must be module-level (spawn pickles them by name). Each child gets
`OMP_NUM_THREADS` from `threads`, so two CPU ranks don't fight over the same cores.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

# Launcher variables a parent run may carry (torchrun, SLURM): the children form their own group.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(queue: Any, rank: int, world_size: int, port: int, device: str, backend: str, threads: int,
           fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    for name in _LAUNCH_VARS:
        os.environ.pop(name, None)
    if world_size > 1 or port:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if threads:
        torch.set_num_threads(threads)
    from ddp_amp.dist import init_distributed, shutdown_distributed
    from ddp_amp.env import detect_env

    try:
        ctx = init_distributed(detect_env(os.environ), device=device, backend=backend,  # type: ignore[arg-type]
                               timeout_s=300)
        try:
            result = fn(ctx, *args)
        finally:
            shutdown_distributed()
        queue.put((rank, "ok", result))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises
        queue.put((rank, "error", f"{type(error).__name__}: {error}"))


def run_ranks(fn: Callable[..., Any], world_size: int, device: str, *args: Any,
              threads: int = 0, timeout: float = 1800, backend: str = "auto") -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` fresh processes (a group if > 1); results by rank.

    `fn` is collective when `world_size > 1`: every rank runs it. `threads`: torch
    intra-op threads per process (0 leaves torch's default). `backend`: as `--backend`; a
    named one forms a group even for one process (DDP on one GPU).
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port() if world_size > 1 else 0
    procs = [context.Process(target=_child, args=(queue, r, world_size, port, device, backend, threads, fn, args))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                # A rank killed by a signal never reports: notice it instead of waiting out the timeout.
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    errors.append(f"no result after {timeout:.0f}s")
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if errors else 60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors or len(results) != world_size:
        raise RuntimeError("benchmark process failed: " + ("; ".join(errors) or "no result"))
    return [results[r] for r in range(world_size)]


def run_fresh(fn: Callable[..., Any], device: str, *args: Any, threads: int = 0) -> Any:
    """Run `fn(ctx, *args)` alone in a fresh process and return its result."""
    return run_ranks(fn, 1, device, *args, threads=threads)[0]
