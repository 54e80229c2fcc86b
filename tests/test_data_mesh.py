"""Data is sharded by the mesh's data-parallel rank, not the world rank: on a real 2 x 2
("dp", "tp") mesh over 4 gloo ranks, ranks that share a data-parallel index read the same
batches, and the two data-parallel groups read disjoint batches that together cover the
data, for every kind of stream (a map-style shard, an iterable dataset, a task's own loader)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DistributedSampler, IterableDataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ddp_amp.data import LoaderRequest, make_stream
from ddp_amp.distributed import DistContext
from tests.multiproc import run_ranks

ITEMS = 16
MICRO_BATCH = 2
BATCHES = ITEMS // 2 // MICRO_BATCH  # one pass over a data-parallel rank's half


class Counting(IterableDataset):
    """The items 0 .. ITEMS-1, the whole stream in every process."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(ITEMS))


def _own_loader(request: LoaderRequest) -> StatefulDataLoader:
    """A task's own loader, sharded by what its request says."""
    data = TensorDataset(torch.arange(ITEMS))
    sampler = DistributedSampler(data, num_replicas=request.world_size, rank=request.rank, seed=request.seed,
                                 drop_last=True)
    return StatefulDataLoader(data, batch_size=request.micro_batch_size, sampler=sampler, drop_last=True)


def _items(stream: Any) -> list[int]:
    """What `BATCHES` micro-batches of `stream` hold, in order (the item itself, or its first field)."""
    drawn = []
    for _ in range(BATCHES):
        batch = next(stream)
        drawn.extend((batch if isinstance(batch, torch.Tensor) else batch[0]).tolist())
    return drawn


def _read_on_mesh(world: DistContext) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ctx = DistContext(world.env, world.device, world.backend, world.store, mesh=mesh)
    requests: list[LoaderRequest] = []

    def recording_loader(request: LoaderRequest) -> StatefulDataLoader:
        requests.append(request)
        return _own_loader(request)

    def stream(train_data: Any, make_loader: Any = None) -> Any:
        return make_stream(train_data, make_loader, "step", ctx, MICRO_BATCH, 0, 3, lambda worker: None)

    return {"dp": (ctx.dp_rank, ctx.dp_size),
            "map": _items(stream(TensorDataset(torch.arange(ITEMS)))),
            "iterable": _items(stream(Counting())),
            "own_loader": _items(stream(None, recording_loader)),
            "request": (requests[0].rank, requests[0].world_size)}


def test_ranks_of_one_data_parallel_index_read_the_same_batches() -> None:
    results = run_ranks(_read_on_mesh, 4, timeout=300)
    # init_device_mesh lays the ranks out row-major: ranks 0, 1 are dp 0 and ranks 2, 3 are dp 1.
    assert [result["dp"] for result in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [result["request"] for result in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    for kind in ("map", "iterable", "own_loader"):
        first, second = results[0][kind], results[2][kind]
        assert results[1][kind] == first and results[3][kind] == second, kind
        assert len(first) == len(second) == ITEMS // 2, kind
        assert not set(first) & set(second), kind
        assert sorted(first + second) == list(range(ITEMS)), kind
