"""The device mesh: the ranks laid out by what they do, outermost first: replicas of a sharded
model, the data-parallel ranks that shard it, the ranks that split each sequence (cp), the
ranks that split each matmul (tp, innermost); and the degrees each layout accepts.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError

# The mesh dimensions that are data parallel: each reads its own data.
DP_DIMS = ("dp_replicate", "dp_shard", "dp")


def dp_dims_of(mesh: DeviceMesh) -> list[str]:
    return [name for name in (mesh.mesh_dim_names or ()) if name in DP_DIMS]


def dp_size_of(mesh: DeviceMesh) -> int:
    size = 1
    for name in dp_dims_of(mesh):
        size *= mesh.size(mesh.mesh_dim_names.index(name))  # type: ignore[union-attr]  # names exist: dp_dims_of
    return size


def dp_rank_of(mesh: DeviceMesh) -> int:
    rank = 0
    for name in dp_dims_of(mesh):  # row-major over the data-parallel dimensions, outer first
        rank = rank * mesh.size(mesh.mesh_dim_names.index(name)) + mesh.get_local_rank(name)  # type: ignore[union-attr]  # names exist
    return rank


def build_mesh(device: torch.device, world_size: int, replicate: int = 1, tensor_parallel: int = 1,
               context_parallel: int = 1) -> DeviceMesh:
    """The device mesh over the group just joined (collective), outermost dimension first:

    - one data-parallel dimension `dp` spanning every rank, which reuses the default group
      (no new one is formed);
    - for `replicate` > 1, `replicate` rows of ranks, `dp_replicate` x `dp_shard`, so that
      FSDP2 shards within a row and all-reduces across rows (HSDP);
    - for `tensor_parallel` T > 1, a `tp` dimension of T innermost (T consecutive ranks, a
      node's: its all-reduces stay on the fast links) beside the data-parallel ones, which
      then span world size / T ranks;
    - for `context_parallel` C > 1, a `cp` dimension of C between them (each sequence split
      over C ranks: its keys and values gathered once per layer, less often than tp's
      all-reduces, so outside tp), the data-parallel ones then spanning world size / (C x T).

    Beyond the first layout it forms a group per row and per column, on every rank together."""
    data = world_size // (tensor_parallel * context_parallel)
    check_replicate(replicate, data, "the data-parallel ranks" if data != world_size else "the world size")
    shape: tuple[int, ...]
    names: tuple[str, ...]
    if replicate == 1:
        shape, names = (data,), ("dp",)
    else:
        shape, names = (replicate, data // replicate), ("dp_replicate", "dp_shard")
    if context_parallel > 1:
        shape, names = (*shape, context_parallel), (*names, "cp")
    if tensor_parallel > 1:
        shape, names = (*shape, tensor_parallel), (*names, "tp")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def build_folded_mesh(device: torch.device, mesh: DeviceMesh) -> DeviceMesh | None:
    """`mesh`'s data-parallel dimensions with its `cp` dimension folded into the innermost of
    them (collective: its own groups), or None for a mesh without one. A mesh of its own,
    laid out as `mesh` is (row-major, tp innermost), not a flattened slice of it: torch
    deprecates slicing flattened dimensions from the root mesh."""
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        return None
    sizes = dict(zip(names, mesh.shape))
    tp = sizes.get("tp", 1)
    shape: tuple[int, ...]
    folded: tuple[str, ...]
    if "dp_replicate" in names:
        shape, folded = (sizes["dp_replicate"], sizes["dp_shard"] * sizes["cp"]), ("dp_replicate", "dp_shard_cp")
    else:
        shape, folded = (sizes["dp"] * sizes["cp"],), ("dp_cp",)
    whole = init_device_mesh(device.type, (*shape, tp), mesh_dim_names=(*folded, "tp"))
    return whole[folded]


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dimensions of `mesh` (what FSDP2 shards and replicates over)."""
    names = tuple(dp_dims_of(mesh))
    if names == tuple(mesh.mesh_dim_names or ()):
        return mesh
    return mesh[names]


def check_tensor_parallel(degree: int, env: DistEnv, flag: str = "--tensor-parallel") -> None:
    """A tensor-parallel degree the ranks can be laid out in: it divides the ranks of a node
    (its all-reduces, one per matmul pair, stay inside the node) and so the world."""
    if degree < 1 or env.local_world_size % degree or env.world_size % degree:
        divisors = [str(d) for d in range(1, env.local_world_size + 1) if env.local_world_size % d == 0]
        raise UsageError(flag, degree, f"a divisor of the ranks on a node ({env.local_world_size}) and of the "
                         f"world size ({env.world_size})", f"one of {', '.join(divisors)}: tensor parallelism "
                         "stays inside a node, where the links are fast")


def check_context_parallel(degree: int, tensor_parallel: int, env: DistEnv,
                           flag: str = "--context-parallel") -> None:
    """A context-parallel degree the ranks can be laid out in: it divides world size / the
    tensor-parallel degree."""
    ranks = env.world_size // max(tensor_parallel, 1)
    if degree < 1 or ranks % degree:
        divisors = [str(d) for d in range(1, ranks + 1) if ranks % d == 0]
        what = "the world size" if tensor_parallel == 1 else f"world size / --tensor-parallel {tensor_parallel}"
        raise UsageError(flag, degree, f"a divisor of {what} ({ranks})",
                         f"one of {', '.join(divisors)}: each sequence is split over that many ranks")


def check_replicate(replicate: int, world_size: int, what: str = "the world size") -> None:
    """A replicate degree the world (`world_size` ranks: `what`) can be laid out in: rows of equal size."""
    if replicate < 1 or world_size % replicate:
        divisors = [str(d) for d in range(1, world_size + 1) if world_size % d == 0]
        raise UsageError("--replicate", replicate, f"a divisor of {what} {world_size}",
                         f"one of {', '.join(divisors)}: each replica shards the model over "
                         "world size / replicate ranks")
