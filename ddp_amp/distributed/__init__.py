"""Layer 2: the process group, collectives, and DDP itself.

- `group`: backend choice, `init_distributed` with a timeout, teardown in the right order;
- `device`: this rank's device and moving batches onto it;
- `collectives`: all-reduce and object collectives, and the agreement primitives
  `on_rank_zero` (rank 0 does it, every rank learns the outcome) and `on_every_rank`;
- `ddp`: the one DDP wrap, its comm hook, and releasing it before teardown;
- `fsdp`: sharding a model over the ranks with FSDP2 instead (`--shard`);
- `failure`: an error on one rank ends every rank within seconds, printed once;
- `liveness`: heartbeats in the store: which peers are alive and making progress;
- `launcher`: whether this worker's launcher (its parent, the store it hosts) is still there;
- `watch`: `PeerWatch`, the thread that stops a rank whose job cannot go on, with one line;
- `spawn`: N local processes that form a group (benchmarks and multi-rank tests).

Imports only `env` and `errors` from ddp_amp.
"""

from ddp_amp.distributed.collectives import (agreed_origin, all_gather_objects, all_reduce_, broadcast_object,
                                      has_peers, mark_agreed, on_every_rank, on_rank_zero)
from ddp_amp.distributed.ddp import CommHook, comm_hook, release_ddp, wrap_ddp
from ddp_amp.distributed.device import DeviceChoice, resolve_device, to_device
from ddp_amp.distributed.fsdp import (ShardOptions, Units, default_units, describe_units, fused_kernel_takes, is_sharded,
                                      local_numel_bytes, local_part, shard_model, shard_units)
from ddp_amp.distributed.failure import announce_failure, publish_failure, published_failure
from ddp_amp.distributed.group import (BackendChoice, DistContext, distributed, init_distributed,
                                resolve_backend, shutdown_distributed)
from ddp_amp.distributed.liveness import Progress
from ddp_amp.distributed.watch import PeerWatch

__all__ = [
    "ShardOptions", "Units", "default_units", "describe_units", "fused_kernel_takes", "is_sharded", "local_numel_bytes", "local_part",
    "shard_model", "shard_units", "BackendChoice", "CommHook", "DeviceChoice", "DistContext", "PeerWatch", "Progress",
    "agreed_origin",
    "all_gather_objects", "all_reduce_", "announce_failure", "publish_failure", "published_failure",
    "broadcast_object", "comm_hook", "distributed", "has_peers",
    "init_distributed", "mark_agreed", "on_every_rank", "on_rank_zero", "release_ddp",
    "resolve_backend", "resolve_device", "shutdown_distributed", "to_device", "wrap_ddp",
]
