"""The open-file limit of the store's host, raised at start, and a job refused where it is too low.

The process that hosts the group's TCPStore (rank 0 under srun and hand-made env:// ranks,
torchrun's agent under torchrun) holds a descriptor per connection to it: torch's own client
of every rank, and, for the failure watch, every rank's heartbeat helper and, while that
helper's beats do not land, the rank's keeper standing in, plus the two judges: up to
STORE_FDS_PER_RANK a rank where torch alone needs one (measured: docs/facts.md). A host whose
soft limit sits between N and 3N (32,768 at 16,384 ranks is a common default) fails some of
those connections: helpers that cannot beat, judges that cannot read. So at start
- every rank raises its soft RLIMIT_NOFILE to its hard limit (`raise_open_files`), and under
  torchrun each node's first worker raises its agent's as well (prlimit on its parent: the
  agent that hosts the store is one of them);
- rank 0, where it sees the store's host (its own process, or its agent listening on its
  own host), publishes that host's limit in the store; every rank reads it and, where it is
  under `needed(N)`, raises the same one-line refusal before any process group forms
  (`agree_open_files`). Where rank 0 cannot see the host (a rendezvous hosted on another
  node), nothing is refused.
"""

from __future__ import annotations

import contextlib
import resource

import torch.distributed as dist

from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError
from ddp_amp.start_parent import PARENT_AT_START

STORE_FDS_PER_RANK = 3  # torch's client, the heartbeat helper's, the keeper's stand-in's
RESERVE_FDS = 256  # the host process's own files, libraries, pipes and sockets
_LIMIT_KEY = "ddp_amp/store_host_open_files"
_READ_KEY = "ddp_amp/store_host_open_files_read"
_ALL_READ_KEY = "ddp_amp/store_host_open_files_all_read"
_LISTEN = "0A"  # a socket's state in /proc/net/tcp: listening


def needed(world_size: int) -> int:
    """Descriptors the store's host needs for `world_size` ranks."""
    return STORE_FDS_PER_RANK * world_size + RESERVE_FDS


def _raise(pid: int) -> int | None:
    """Raise `pid`'s soft open-file limit (0: this process's) to its hard one; the soft limit
    afterwards (None where it cannot be read; unchanged where it cannot be raised)."""
    try:
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        if soft != hard and soft != resource.RLIM_INFINITY:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
        return int(resource.prlimit(pid, resource.RLIMIT_NOFILE)[0])
    except (OSError, ValueError):  # another user's process, or gone
        return None


def raise_open_files(env: DistEnv) -> None:
    """This process's soft limit up to its hard one; under torchrun, each node's first worker
    does the same for its agent, which may host the store (every worker then sees the same)."""
    _raise(0)
    if env.agent_hosts_store and env.local_rank == 0:
        _raise(PARENT_AT_START)


def _listens_here(port: int) -> bool:
    """Whether a socket of this host (this network namespace) listens on TCP `port`."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        return True
    return False


def store_host_limit(env: DistEnv) -> int | None:
    """The store's host's soft open-file limit as rank 0 sees it (after `raise_open_files`):
    its own where it hosts the store, its agent's where the agent listens on this host;
    None where it cannot tell, or where there is no limit."""
    if not env.agent_hosts_store:
        limit = _raise(0)
    elif _listens_here(env.master_port):
        limit = _raise(PARENT_AT_START)
    else:
        return None
    return None if limit is None or limit == resource.RLIM_INFINITY else limit


def _refusal(limit: int, env: DistEnv) -> UsageError:
    host = "torchrun's agent" if env.agent_hosts_store else "rank 0"
    return UsageError("open files of the store's host", limit,
                      f"at least {needed(env.world_size):,} for {env.world_size:,} ranks ({host} at "
                      f"{env.master_addr}: {STORE_FDS_PER_RANK} per rank, for torch's store client and the "
                      f"failure watch's heartbeat helper and stand-in, plus {RESERVE_FDS})",
                      "raise the hard limit where the job starts (ulimit -Hn, nofile in "
                      "/etc/security/limits.conf, LimitNOFILE= of a systemd unit, srun --propagate=NOFILE); "
                      "ddp_amp raises the soft limit to it")


def agree_open_files(store: dist.Store, env: DistEnv) -> None:
    """Every rank (collective, over the store): raise the same one-line UsageError where the
    store's host's limit, as rank 0 sees it, is too low for the world size."""
    if env.rank == 0:
        limit = store_host_limit(env)
        store.set(_LIMIT_KEY, "" if limit is None else str(limit))
    else:
        text = store.get(_LIMIT_KEY).decode()
        limit = int(text) if text else None
    if limit is None or limit >= needed(env.world_size):
        return
    # Refused: rank 0's store may go with rank 0's process, so rank 0 leaves once every
    # other rank has read the limit.
    if env.rank == 0 and not env.agent_hosts_store:
        with contextlib.suppress(RuntimeError, dist.DistError):
            store.wait([_ALL_READ_KEY])
    elif env.rank != 0 and store.add(_READ_KEY, 1) == env.world_size - 1:
        store.set(_ALL_READ_KEY, "1")
    raise _refusal(limit, env)
