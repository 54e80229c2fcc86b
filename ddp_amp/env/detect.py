"""Which launcher started this process, and where it sits in the job.

`detect_env` is a pure function of an environment mapping: it never reads or writes
`os.environ` itself, so it can be tested with plain dicts. Precedence: torchrun (also any
launcher that sets the `env://` variables) > SLURM under `srun` > a single process.
torchrun wins because users often run one torchrun per node inside a SLURM allocation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import hostlist

from ddp_amp.errors import UsageError

Launcher = Literal["torchrun", "slurm", "single"]

# Ports below the Linux ephemeral range (32768+) so the store port does not collide with
# outgoing connections; a job id maps to one port so every task computes the same one.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: Launcher = "single"
    restart_count: int = 0
    # The launcher's name for this run, stable across its restarts and requeues, or "" where
    # it gives none (see `launcher_run_id`).
    run_id: str = ""
    # torchrun's agent already hosts the TCP store at MASTER_ADDR:MASTER_PORT; rank 0 must
    # then connect as a client instead of opening a second server on the same port.
    agent_hosts_store: bool = False
    # Started by torchrun's agent, which then outlives this worker as its parent: the agent
    # says whether it hosts the store in every torch (2.4's does not under c10d rendezvous).
    under_agent: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UsageError(name, None, "an integer set by the launcher",
                             "launch with torchrun/srun, or unset the partial env:// variables")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(name, raw, "an integer", "check the launcher's environment") from None


def _check_rank(rank_name: str, rank: int, size_name: str, size: int) -> None:
    if size < 1:
        raise UsageError(size_name, size, "an integer >= 1", "check the launcher's environment")
    if not 0 <= rank < size:
        raise UsageError(rank_name, rank, f"0 <= {rank_name} < {size_name}={size}",
                         "the launcher's variables disagree; do not set them by hand")


def _port(name: str, port: int) -> int:
    if not 1 <= port <= 65535:
        raise UsageError(name, port, "a TCP port in 1..65535", "pick a free port, e.g. 29500")
    return port


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    rank = _int(environ, "RANK")
    world_size = _int(environ, "WORLD_SIZE")
    local_rank = _int(environ, "LOCAL_RANK", default=rank)
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", default=world_size)
    _check_rank("RANK", rank, "WORLD_SIZE", world_size)
    _check_rank("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    if local_world_size > world_size:
        raise UsageError("LOCAL_WORLD_SIZE", local_world_size, f"<= WORLD_SIZE={world_size}",
                         "the launcher's variables disagree")
    master_addr = environ.get("MASTER_ADDR", "")
    if not master_addr:
        raise UsageError("MASTER_ADDR", master_addr, "a host name or address",
                         "torchrun sets it; a hand-made env:// launch must export it")
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(environ, "GROUP_RANK", default=rank // local_world_size),
        master_addr=master_addr,
        master_port=_port("MASTER_PORT", _int(environ, "MASTER_PORT")),
        launcher="torchrun",
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
        run_id=launcher_run_id(environ),
        agent_hosts_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        under_agent="TORCHELASTIC_USE_AGENT_STORE" in environ,
    )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist such as ``gpu[01-03,7],cpu5`` into host names."""
    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist:
        raise UsageError("SLURM_JOB_NODELIST", nodelist, "a SLURM hostlist like node[01-04]",
                         "check the job's node list with `scontrol show hostnames`") from None
    if not hosts:
        raise UsageError("SLURM_JOB_NODELIST", nodelist, "at least one host", "check `scontrol show hostnames`")
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Read this node's entry of SLURM's compressed ``2(x3),1`` tasks-per-node form."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        try:
            counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
        except ValueError:
            raise UsageError("SLURM_TASKS_PER_NODE", tasks_per_node, "a form like 2(x3),1",
                             "check the job's environment") from None
    if node_id >= len(counts):
        raise UsageError("SLURM_NODEID", node_id, f"< {len(counts)} nodes in the tasks-per-node list",
                         "the SLURM variables disagree")
    return counts[node_id]


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    rank = _int(environ, "SLURM_PROCID")
    world_size = _int(environ, "SLURM_NTASKS")
    local_rank = _int(environ, "SLURM_LOCALID")
    node_rank = _int(environ, "SLURM_NODEID", default=0)
    _check_rank("SLURM_PROCID", rank, "SLURM_NTASKS", world_size)
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    local_world_size = _tasks_on_node(per_node, node_rank) if per_node else world_size
    _check_rank("SLURM_LOCALID", local_rank, "tasks on this node", local_world_size)
    job_id = _int(environ, "SLURM_JOB_ID", default=0)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "localhost"
    if "MASTER_PORT" in environ:
        port = _port("MASTER_PORT", _int(environ, "MASTER_PORT"))
    else:
        port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=environ.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        master_port=port,
        launcher="slurm",
        restart_count=_int(environ, "SLURM_RESTART_COUNT", default=0),
        run_id=launcher_run_id(environ),
    )


# torchrun's rendezvous id when none is given: every such launch shares it, so it names no run.
TORCHRUN_SHARED_IDS = ("", "none")


def launcher_run_id(environ: Mapping[str, str]) -> str:
    """The id that names this run for the launcher, stable across restarts; "" if none does.

    In order: the SLURM job id (with the array task, `<array job>_<task>`; a requeued job
    keeps it), then torchrun's rendezvous id where it names this run (`--standalone` makes
    a fresh one per launch; `none`, torchrun's default, is shared by every launch).
    """
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID", ""), environ.get("SLURM_ARRAY_TASK_ID", "")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    if environ.get("SLURM_JOB_ID"):
        return environ["SLURM_JOB_ID"]
    rendezvous = environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if rendezvous.lower() in TORCHRUN_SHARED_IDS else rendezvous


def launched_by_torchrun(environ: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "WORLD_SIZE" in environ)


def launched_by_srun(environ: Mapping[str, str]) -> bool:
    # srun sets the SLURM_STEP_* family for each job step; a batch script that runs python
    # directly has SLURM_PROCID=0 too but no step of its own tasks, and must stay single.
    return "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ


def detect_env(environ: Mapping[str, str]) -> DistEnv:
    """Describe this process's place in the job from an environment mapping (pure)."""
    if launched_by_torchrun(environ):
        return _from_torchrun(environ)
    if launched_by_srun(environ):
        return _from_slurm(environ)
    return DistEnv(restart_count=0)
