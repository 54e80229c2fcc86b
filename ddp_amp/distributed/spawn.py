"""Run a function on N fresh local processes that form a real process group.

    results = run_ranks(fn, 2, arg, device="cpu")   # fn(ctx, arg) on ranks 0 and 1

Each child is a fresh process that has run nothing yet, joins the group through ddp_amp's
own launcher detection and `init_distributed`, calls `fn(ctx, *args)` and sends back what
it returned; the parent returns the results in rank order. Used by the benchmark (a fresh
process per trial, so memory peaks do not carry over) and by the multi-rank tests. `fn`
must be a module-level function of an importable module: it is pickled by name.

The children fork from a server process that imported torch once (multiprocessing's
forkserver): a child then starts at once, where a new interpreter spends seconds of CPU
importing torch (docs/facts.md, "A new interpreter spends seconds importing torch"). The
server was started with the environment and standard streams of the parent's first call, so
each child takes the parent's current ones from its arguments (a test that captures its
output then sees its own children's); multiprocessing itself gives it the parent's directory
and sys.path.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.reduction
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

# Launcher variables a parent run may carry (torchrun, SLURM): the children form their own group.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Imported by the fork server before it forks any child: what every child needs anyway.
# transformers' Llama too where it is installed (the forkserver skips a module it cannot import):
# the benchmark's and the tests' children build it, and it costs a new interpreter seconds more.
_PRELOAD = ["torch", "torch.distributed", "ddp_amp.distributed.group", "ddp_amp.env",
            "transformers.models.llama.modeling_llama"]


def _received_fd(wrapped: Any) -> int:
    return int(wrapped.detach())


class _ParentFd:
    """One of the parent's file descriptors as it is when a child starts: pickled as a
    descriptor passed to the child (the start method's own fd passing), a number there."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _received_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _start_context() -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():  # not on every platform
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _child(queue: Any, rank: int, world_size: int, port: int, device: str, backend: str, threads: int,
           dist_timeout_s: float, fn: Callable[..., Any], args: tuple[Any, ...],
           environ: dict[str, str], streams: tuple[int, int]) -> None:
    for received, target in zip(streams, (1, 2)):  # the parent's stdout and stderr
        if received != target:
            os.dup2(received, target)
            os.close(received)
    os.environ.clear()
    os.environ.update(environ)
    for name in _LAUNCH_VARS:
        os.environ.pop(name, None)
    if world_size > 1:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if threads:
        torch.set_num_threads(threads)
    from ddp_amp.distributed.group import distributed
    from ddp_amp.env import detect_env

    try:
        buffer = io.BytesIO()
        # Left after fn's DDP objects are gone: they were local to fn.
        with distributed(detect_env(os.environ), device=device, backend=backend,  # type: ignore[arg-type]  # strs, checked at run time
                         timeout_s=dist_timeout_s) as ctx:
            # torch.save, not the queue's pickling: tensors in a result then travel as
            # bytes, not as shared memory that would vanish with this process.
            torch.save(fn(ctx, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
              backend: str = "auto", threads: int = 1, timeout: float = 600.0,
              dist_timeout_s: float = 120.0) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` fresh processes (a group if > 1); results by rank.

    `fn` is collective when `world_size > 1`: every rank runs it. `threads`: torch
    intra-op threads per process (0 leaves torch's default; 1 keeps ranks from fighting
    over a few cores). `backend`: as `--backend`; a named one forms a group even for one
    process (DDP on one GPU). Raises RuntimeError naming the rank that failed or died.
    """
    context = _start_context()
    queue = context.Queue()
    port = free_port() if world_size > 1 else 0
    procs = [context.Process(target=_child, args=(queue, r, world_size, port, device, backend, threads,
                                                  dist_timeout_s, fn, args, dict(os.environ),
                                                  (_ParentFd(1), _ParentFd(2))))
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
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if errors else 60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors or len(results) != world_size:
        raise RuntimeError("rank process failed: " + ("; ".join(errors) or "no result"))
    return [results[r] for r in range(world_size)]
