"""Run test code in real processes: N gloo ranks of a function, or the CLI under torchrun.

`run_ranks(fn, world_size, *args)` is the library's own (`ddp_amp.distributed.spawn`): fresh
processes that join a real gloo group through ddp_amp's env detection and init, call
`fn(ctx, *args)` and return what each rank returned, in rank order. `fn` must be a
module-level function of an importable module (it is pickled by name).
`run_ranks(in_turn, world_size, (fn, *args), (fn2, *args2))` runs several such functions in
the same processes, one after the other: one start-up of N processes instead of several.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_amp.distributed.spawn import free_port, run_ranks

__all__ = ["REPO_ROOT", "child_pids", "cli_env", "free_port", "in_turn", "is_running", "kill_when", "run_ranks",
           "run_train", "slow_writes_env"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def in_turn(ctx: object, *calls: tuple[Any, ...]) -> list[Any]:
    """`fn(ctx, *args)` for each `(fn, *args)` of `calls`, in order, in this rank's process
    (collective where the functions are): their results, in that order. The group is the
    caller's (run_ranks's), so each function's Session leaves it formed for the next."""
    return [fn(ctx, *args) for fn, *args in calls]


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


def slow_writes_env(seconds: float, inside: str = "/.tmp-", **extra: str) -> dict[str, str]:
    """`cli_env` for a process whose checkpoint files (or files under a path holding `inside`)
    each take `seconds` longer to write (tests/slow_writes/sitecustomize.py), so a test can
    kill it in the middle of a save."""
    env = cli_env(DDP_AMP_TEST_SLOW_WRITES_S=str(seconds), DDP_AMP_TEST_SLOW_WRITES_IN=inside, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "tests" / "slow_writes"), env["PYTHONPATH"]])
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


def kill_when(proc: subprocess.Popen[str], ready: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (polled); fail if it exits or `timeout` passes first."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, f"never reached {what}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat after the command name: [state, ppid, ...] (Linux); [] where it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return []


def is_running(pid: int) -> bool:
    """Whether process `pid` runs: a zombie no longer does (nobody may be left to reap it)."""
    state = _stat(pid)
    return bool(state) and state[0] not in "ZX"


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [int(path.parent.name) for path in Path("/proc").glob("[0-9]*/stat")
            if (state := _stat(path.parent.name)) and int(state[1]) == pid]

