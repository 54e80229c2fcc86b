"""Layer 2: the process group, its mesh, and collectives.

- `group`: backend choice, `init_distributed` with a timeout, teardown in the right order;
- `mesh`: the ranks laid out as replicas, shards, sequence splits (cp) and matmul splits (tp);
- `device`: this rank's device and moving batches onto it;
- `collectives`: all-reduce and object collectives, and the agreement primitives
  `on_rank_zero` (rank 0 does it, every rank learns the outcome) and `on_every_rank`;
- `local_shard`: this rank's part of a tensor that may be sharded (a DTensor), and whether a
  model was sharded;
- `failure`: an error on one rank ends every rank within seconds, printed once;
- `liveness`: heartbeats in the store: which peers are alive and making progress;
- `launcher`: whether this worker's launcher (its parent, the store it hosts) is still there;
- `watch`: `PeerWatch`, the thread that stops a rank whose job cannot go on, with one line;
- `spawn`: N local processes that form a group (benchmarks and multi-rank tests).

Imports only `env` and `errors` from ddp_amp.
"""

from ddp_amp.distributed.collectives import (agreed_origin, all_gather_objects, all_reduce_, broadcast_object,
                                      has_peers, mark_agreed, on_every_rank, on_rank_zero)
from ddp_amp.distributed.device import DeviceChoice, resolve_device, to_device
from ddp_amp.distributed.failure import announce_failure, publish_failure, published_failure
from ddp_amp.distributed.group import (BackendChoice, DistContext, distributed, init_distributed, resolve_backend,
                                      shutdown_distributed)
from ddp_amp.distributed.liveness import Liveness, Progress
from ddp_amp.distributed.mesh import check_context_parallel, check_tensor_parallel, data_mesh
from ddp_amp.distributed.local_shard import is_sharded, local_numel_bytes, local_part
from ddp_amp.distributed.watch import PeerWatch

__all__ = [
    "BackendChoice", "DeviceChoice", "DistContext", "Liveness", "PeerWatch", "Progress", "agreed_origin",
    "all_gather_objects", "all_reduce_", "announce_failure", "broadcast_object", "check_context_parallel",
    "check_tensor_parallel", "data_mesh", "distributed", "has_peers", "init_distributed", "is_sharded",
    "local_numel_bytes", "local_part", "mark_agreed", "on_every_rank", "on_rank_zero",
    "publish_failure", "published_failure", "resolve_backend", "resolve_device", "shutdown_distributed", "to_device",
]
