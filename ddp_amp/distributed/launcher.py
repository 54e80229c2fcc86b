"""Whether this process still has its launcher: the parent that started it, the store it hosts.

A worker whose launcher died (torchrun killed with SIGKILL, its node's agent gone) trains
on by itself: nothing in gloo looks at the launcher, the run lock stays held, and every
call to the launcher's store fails with a c10d warning and a stack trace. The watch
thread (`watch.PeerWatch`) asks this module each poll:
- `parent_gone`: torchrun's agent (and slurmstepd under srun) is the worker's direct
  parent, so a parent pid other than the one seen at start means it ended and this
  process was re-parented. (Linux's PR_SET_PDEATHSIG would fire on the death of the
  parent *thread* that forked us, and end the process without a word.)
- `store_answers`: after a call to the store failed, a plain TCP connect tells whether
  its server still listens, without a c10d warning per try.
Before the watch runs, `check_launcher_store` covers a launcher killed while its workers
start: TCPStore's connect would retry for the whole --dist-timeout (600 s by default).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from ddp_amp.env import DistEnv
from ddp_amp.start_parent import PARENT_AT_START
from ddp_amp.errors import UsageError

REFUSED_FOR_S = 5.0  # a launcher's store that refuses connections this long is gone


def _command_name(pid: int) -> str:
    """'torchrun' for torch's launcher, else the program's base name ('' where unreadable)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    words = [word.decode(errors="replace") for word in argv if word]
    if any(word in ("torch.distributed.run", "torchrun") or word.endswith("/torchrun") for word in words):
        return "torchrun"
    return os.path.basename(words[0]) if words else ""


class LauncherCheck:
    """The launcher this process was started by, as seen at start, and its store's address."""

    def __init__(self, env: DistEnv, store: dist.Store | None) -> None:
        # Only a launcher that outlives its workers is watched: torchrun's agent (whether or
        # not it hosts the store), slurmstepd. A hand-made env:// launch may well have a parent that ends.
        watched = env.under_agent or env.launcher == "slurm"
        # The parent when the process started: the agent may have died since (start_parent.py).
        self.parent_pid = PARENT_AT_START if watched else None
        self.name = (_command_name(self.parent_pid) or env.launcher) if self.parent_pid else ""
        self.store_by_launcher = env.agent_hosts_store
        self.address = _store_address(store)

    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def describe_parent(self) -> str:
        return f"the launcher ({self.name}, pid {self.parent_pid}) is gone"

    def describe_store(self) -> str:
        where = f" at {self.address[0]}:{self.address[1]}" if self.address else ""
        host = "the launcher" if self.store_by_launcher else "rank 0"
        return f"the job's store{where} stopped answering (its host, {host}, is gone)"

    def store_answers(self, timeout_s: float = 1.0) -> bool | None:
        """Whether the store's server accepts a connection; None where its address is unknown."""
        if self.address is None:
            return None
        try:
            with socket.create_connection(self.address, timeout=timeout_s):
                return True
        except OSError:
            return False


def _store_address(store: dist.Store | None) -> tuple[str, int] | None:
    """Host and port of the TCP store under `store` (and its prefixes), or None."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def check_launcher_store(env: DistEnv) -> None:
    """Under torchrun, before connecting to its agent's store: stop where nothing listens.

    The agent opens its store before it starts its workers, so connections refused for
    REFUSED_FOR_S mean it is gone. Any other trouble (a slow or unreachable host) is left to
    TCPStore's connect and its timeout.
    """
    if not env.agent_hosts_store:
        return
    deadline = time.monotonic() + REFUSED_FOR_S
    while True:
        try:
            with socket.create_connection((env.master_addr, env.master_port), timeout=REFUSED_FOR_S):
                return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise UsageError("MASTER_ADDR:MASTER_PORT", f"{env.master_addr}:{env.master_port}",
                                 "the store of the torchrun agent that started this worker",
                                 "nothing listens there: the launcher is gone (killed?); start the job again, "
                                 "--resume auto goes on from the last checkpoint") from None
            time.sleep(0.25)
        except OSError:
            return

