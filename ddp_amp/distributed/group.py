"""Process-group lifecycle: backend choice, init with a timeout, teardown.

A single process gets no process group at all (unless a backend is named); every
collective in `collectives.py` is a no-op for a world of one, so the trainer runs the same
code path everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ddp_amp.distributed.device import DeviceChoice, resolve_device
from ddp_amp.distributed.held_stderr import HeldStderr
from ddp_amp.distributed.launcher import check_launcher_store
from ddp_amp.distributed.mesh import (dp_rank_of, dp_size_of, build_folded_mesh, build_mesh, check_context_parallel,
                                      check_replicate, check_tensor_parallel, data_mesh)
from ddp_amp.distributed.liveness import Liveness, Progress, remember_prefix
from ddp_amp.distributed.open_files import agree_open_files, raise_open_files
from ddp_amp.distributed.watch import start_heart, stop_watches
from ddp_amp.env import DistEnv
from ddp_amp.errors import StoreUnreached, UsageError

log = logging.getLogger(__name__)

BackendChoice = Literal["auto", "nccl", "gloo"]


@dataclass(frozen=True)
class DistContext:
    """The launch environment plus what was chosen for it: device and backend."""

    env: DistEnv
    device: torch.device
    backend: str | None  # None: no process group (a world of one)
    # The group's key-value store (this attempt's prefix), where a failing rank leaves its
    # error for the others (failure.py); None without a group of several ranks.
    store: dist.Store | None = field(default=None, compare=False, repr=False)
    # What this rank's loop has done (its last step, its run's last checkpoint), read by the
    # rank's watch thread for its heartbeat (liveness.py); the loop sets plain attributes.
    progress: Progress = field(default_factory=Progress, compare=False, repr=False)
    # The ranks laid out by what they do: one data-parallel dimension ("dp"), or replicas of
    # a sharded model, ("dp_replicate", "dp_shard") for HSDP; then "cp", where sequences are
    # split, and "tp", innermost, where matmuls are split (build_mesh). None without a group.
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    # Where sequences are split: the mesh FSDP2 spreads the model over, the data-parallel
    # dimensions with "cp" folded into the innermost ("dp_cp", or "dp_replicate" x
    # "dp_shard_cp"): the ranks of a cp group hold one model and reduce its gradients together.
    # None without a cp dimension (FSDP2 then spreads it over `data_mesh(mesh)`).
    folded_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    # How often the ranks beat and how long one may be silent: the same on every rank.
    liveness: Liveness = field(default_factory=Liveness, compare=False)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks: what data it reads, whether it
        is "rank 0 of its replica". Equal to the world rank only while every dimension of
        the mesh is data parallel."""
        if self.mesh is None:
            return self.env.rank
        return dp_rank_of(self.mesh)

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks read different data."""
        if self.mesh is None:
            return self.env.world_size
        return dp_size_of(self.mesh)

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def tp_size(self) -> int:
        """How many ranks split each matmul (the mesh's `tp` dimension; 1 without one)."""
        names = (self.mesh.mesh_dim_names or ()) if self.mesh is not None else ()
        return self.mesh.size(names.index("tp")) if self.mesh is not None and "tp" in names else 1

    @property
    def cp_size(self) -> int:
        """How many ranks split each sequence (the mesh's `cp` dimension; 1 without one)."""
        names = (self.mesh.mesh_dim_names or ()) if self.mesh is not None else ()
        return self.mesh.size(names.index("cp")) if self.mesh is not None and "cp" in names else 1

    @property
    def spread_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards and replicates the model over: the data-parallel dimensions,
        with the cp dimension folded in where there is one."""
        if self.folded_mesh is not None:
            return self.folded_mesh
        return data_mesh(self.mesh) if self.mesh is not None else None

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def has_group(self) -> bool:
        return self.backend is not None and dist.is_initialized()


def resolve_backend(choice: BackendChoice, device: torch.device) -> str:
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise UsageError("--backend", choice, "a CUDA device for nccl", "use --backend gloo on CPU")
    return choice


def _open_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    check_launcher_store(env)  # a launcher killed while this worker started: no 600 s of retries
    raise_open_files(env)  # the store's host holds up to 3 descriptors a rank (open_files.py)
    is_server = env.rank == 0 and not env.agent_hosts_store
    # Every rank passes wait_for_workers=True: that is what registers a client with the
    # server's worker count (the server alone then blocks until all have joined).
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_server,
                              timeout=timeout, wait_for_workers=True)
    except (dist.DistStoreError, dist.DistNetworkError) as error:
        if is_server:
            raise
        raise _NeverReached(error) from error
    # After a torchrun restart the agent's store still holds the keys of the failed
    # attempt; re-forming gloo on them failed or hung in 5 of 8 tries, and a fresh prefix
    # per attempt gave each attempt clean keys: 8 of 8 (docs/facts.md, torchrun restarts).
    prefix = f"ddp_amp/attempt_{env.restart_count}"
    prefixed = dist.PrefixStore(prefix, store)
    remember_prefix(prefixed, prefix)
    agree_open_files(prefixed, env)  # a store host that would run out of descriptors: refused on every rank
    return prefixed


class _NeverReached(Exception):
    """This rank's client never connected to the store: its host never came."""


def _late(env: DistEnv, timeout: timedelta, error: Exception) -> UsageError:
    """The one line for ranks that did not all reach the rendezvous within the timeout;
    a StoreUnreached, printed by every rank that raises it, where this rank never reached
    the store (its host, rank 0 under srun or env://, never came: nobody else can say it)."""
    reached = not isinstance(error, _NeverReached)
    error = error if reached else error.args[0]
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not reached:
        host = "torchrun's agent" if env.agent_hosts_store else "rank 0"
        return StoreUnreached("--dist-timeout", f"{timeout.total_seconds():g}",
                              f"every rank at the rendezvous within it (rank {env.rank} could not reach the store "
                              f"at {env.master_addr}:{env.master_port}: {text})",
                              f"the store's host ({host}) did not start, or not at that address: look at its "
                              "output, or raise --dist-timeout")
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    who = (f"{joined.group(1)} of {joined.group(2)} ranks joined" if joined
           else f"rank {env.rank} could not reach the store at {env.master_addr}:{env.master_port}")
    return UsageError("--dist-timeout", f"{timeout.total_seconds():g}",
                      f"every rank at the rendezvous within it ({who}: {text})",
                      "a rank started late or not at all (a slow node, a slow shared file system, a "
                      "failed start on another node): look at the missing ranks' output, or raise --dist-timeout")


def init_distributed(env: DistEnv, device: DeviceChoice = "auto", backend: BackendChoice = "auto",
                     timeout_s: float = 600.0, group_of_one: bool = False,
                     liveness: Liveness | None = None, replicate: int = 1,
                     host_collectives: bool = False, tensor_parallel: int = 1,
                     context_parallel: int = 1) -> DistContext:
    """Choose the device and join the process group (collective); each rank's heartbeat
    starts with it, at `liveness`'s poll (the defaults where None). `replicate` > 1 lays
    the ranks out as replicas of a sharded model (`build_mesh`); it must divide the world.
    `tensor_parallel` > 1 adds a `tp` dimension of that size innermost; it must divide the ranks
    of a node, and `replicate` then divides the data-parallel ranks (world size / it).
    `context_parallel` > 1 adds a `cp` dimension outside `tp`; it must divide world size / tp.

    A world of one joins none, unless a backend is named or `group_of_one` asks for one (a
    sharded model needs a group): then it forms a group of one, so that the DDP or FSDP path
    runs and can be checked on one GPU.

    `host_collectives` adds gloo for host tensors beside NCCL (a sharded model offloaded to
    the host: its gradients' norm and finite flags are reduced where they live, and NCCL
    has no host path).
    """
    global _OUR_GROUP
    liveness = liveness if liveness is not None else Liveness()
    liveness.check()
    # before a group or a file exists
    check_tensor_parallel(tensor_parallel, env)
    check_context_parallel(context_parallel, tensor_parallel, env)
    check_replicate(replicate, env.world_size // (tensor_parallel * context_parallel),
                    "the data-parallel ranks" if tensor_parallel * context_parallel > 1 else "the world size")
    torch_device = resolve_device(device, env, backend)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    if not env.is_distributed and backend == "auto" and not group_of_one:
        return DistContext(env, torch_device, None, liveness=liveness)
    chosen = resolve_backend(backend, torch_device)
    if dist.is_initialized():  # idempotent: a user's script, or a caller of ours, may have joined already
        # The group's store and progress as we made them (the heartbeat helper follows that
        # progress); torch's default store wraps ours in a prefix of its own.
        store, progress = _OUR_GROUP if _OUR_GROUP is not None else (_default_store(), Progress())
        return _with_mesh(DistContext(env, torch_device, dist.get_backend(), store, progress, liveness=liveness),
                          replicate, tensor_parallel, context_parallel)
    timeout = timedelta(seconds=timeout_s)
    # A rank that never arrives makes every other rank's store call fail, and c10d print a
    # stack trace on each: held back, ddp_amp's one line says it (held_stderr.py).
    with HeldStderr() if env.is_distributed else contextlib.nullcontext() as held:
        try:
            # A group of one needs no rendezvous: an in-memory store, no port to claim.
            store = _open_store(env, timeout) if env.is_distributed else dist.HashStore()
            per_device = f"cuda:{chosen},cpu:gloo" if host_collectives and chosen == "nccl" else chosen
            dist.init_process_group(per_device, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout)
        except (dist.DistStoreError, dist.DistNetworkError, _NeverReached) as error:
            if held is not None:
                held.drop_c10d()
            raise _late(env, timeout, error) from None
    log.debug("rank %d joined %s group of %d", env.rank, chosen, env.world_size)
    # Every rank beats from here on, in a process of its own (heartbeat.py): a rank's loop
    # may start much later (its data loads), and its silence clock starts at its first beat.
    progress = Progress()
    _OUR_GROUP = (store if env.is_distributed else None), progress
    start_heart(store if env.is_distributed else None, env, liveness, progress)
    # The group is formed on our own store first (a per-attempt prefix, above); the mesh
    # then lays the ranks out on it.
    return _with_mesh(DistContext(env, torch_device, chosen, store if env.is_distributed else None, progress,
                                  liveness=liveness), replicate, tensor_parallel, context_parallel)


def _with_mesh(ctx: DistContext, replicate: int, tensor_parallel: int, context_parallel: int) -> DistContext:
    """`ctx` with the ranks of its group laid out (collective)."""
    mesh = build_mesh(ctx.device, dist.get_world_size(), replicate, tensor_parallel, context_parallel)
    return dataclasses.replace(ctx, mesh=mesh, folded_mesh=build_folded_mesh(ctx.device, mesh))


# The store (None for a group of one) and progress of the group init_distributed formed,
# while it lasts: a later init_distributed in the process (a Session inside a group of ours)
# shares them.
_OUR_GROUP: tuple[dist.Store | None, Progress] | None = None


def _default_store() -> dist.Store | None:
    """The store of a group someone else made, where torch exposes it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def shutdown_distributed(finished: bool = True) -> None:
    """Leave the process group. Call only after every DDP model has been freed.

    Destroying a gloo group while a DDP reducer is alive can abort the process
    (`terminate called without an active exception`, docs/facts.md); collecting first makes
    sure the reducer and its hooks are gone before the group's threads are joined. The
    failure watches still running stop first; `finished` (False where this process leaves
    because it failed): they tell the peers this rank is done, not silent (watch.py).
    """
    global _OUR_GROUP
    stop_watches(finished)
    gc.collect()
    _OUR_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def distributed(env: DistEnv, device: DeviceChoice = "auto", backend: BackendChoice = "auto",
                timeout_s: float = 600.0) -> Iterator[DistContext]:
    """Join the group for the duration of a block and always leave it (collective)."""
    ctx = init_distributed(env, device, backend, timeout_s)
    try:
        yield ctx
    except BaseException:
        shutdown_distributed(finished=False)
        raise
    shutdown_distributed()
