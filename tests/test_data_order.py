"""The order map-style data is visited in (ddp_amp/data/order.py, batches.py): a seeded
permutation per epoch computed per index, dealt out so that optimizer step k holds the same
samples whatever the world size, micro-batch and accumulation that make up the global batch,
across resumes that change the world size; and a rank's memory that does not grow with the
number of windows (1e9 of them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from ddp_amp.bench.data import memory_probe, sparse_entry
from ddp_amp.data import BatchStream
from ddp_amp.data.order import GlobalOrder
from ddp_amp.trainer.resume import map_data_position


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1000, 4097])
def test_each_epoch_is_a_permutation_and_epochs_differ(size: int) -> None:
    order = GlobalOrder(size, seed=5)
    epochs = [order.take(epoch, 0, size) for epoch in range(3)]
    for visited in epochs:
        assert sorted(visited.tolist()) == list(range(size))
    if size >= 64:
        assert not np.array_equal(epochs[0], epochs[1])
        assert not np.array_equal(GlobalOrder(size, seed=6).take(0, 0, size), epochs[0])
        assert abs(np.corrcoef(np.arange(size), epochs[0])[0, 1]) < 0.2  # shuffled, not shifted


def test_any_stretch_of_positions_is_computed_alone() -> None:
    order = GlobalOrder(10**12, seed=1)  # far more than could be listed
    whole = order.take(2, 5_000, 300)
    assert np.array_equal(order.take(2, 5_100, 50), whole[100:150])
    assert len(set(whole.tolist())) == 300 and whole.max() < 10**12


class _Indices(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def _step_sets(size: int, global_batch: int, ranks: int, accumulation: int, steps: int,
               position: dict[str, int] | None = None) -> tuple[list[list[int]], dict[str, int], dict[str, int]]:
    """The samples of each optimizer step over `ranks` data-parallel ranks, from `position`;
    and the streams' final position and geometry."""
    micro = global_batch // (ranks * accumulation)
    streams = [BatchStream(_Indices(size), micro, rank, ranks, seed=3, device=torch.device("cpu"),
                           samples_per_step=global_batch) for rank in range(ranks)]
    for stream in streams:
        if position is not None:
            stream.load_state_dict(position)
    sets = []
    for _ in range(steps):
        drawn = [int(i) for stream in streams for _ in range(accumulation) for i in next(stream)]
        assert len(set(drawn)) == global_batch  # disjoint shares
        sets.append(sorted(drawn))
    geometry = {"world_size": ranks, "micro_batch_size": micro, "batches_per_epoch": streams[0].batches_per_epoch}
    return sets, streams[0].state_dict(), geometry


def test_step_k_holds_the_same_samples_on_any_world_size() -> None:
    size, batch, steps = 103, 8, 30  # 12 steps an epoch: the run crosses two epoch ends
    straight, _, _ = _step_sets(size, batch, 1, 1, steps)
    for ranks, accumulation in ((2, 1), (4, 1), (2, 2), (1, 8), (8, 1)):
        assert _step_sets(size, batch, ranks, accumulation, steps)[0] == straight, (ranks, accumulation)
    epochs = [sorted(i for s in straight[k:k + 12] for i in s) for k in (0, 12)]
    assert len(set(epochs[0])) == 96 and straight[:12] != straight[12:24]  # a whole epoch, then a new order


def test_a_run_resumed_on_4_then_2_then_1_ranks_trains_on_the_straight_runs_samples() -> None:
    size, batch = 103, 8
    straight, _, _ = _step_sets(size, batch, 1, 1, 30)
    first, position, geometry = _step_sets(size, batch, 4, 1, 7)
    mapped = map_data_position(geometry, position, 2, batch // 2, 12)
    second, position, geometry = _step_sets(size, batch, 2, 1, 9, mapped)
    mapped = map_data_position(geometry, position, 1, batch, 12)
    third, _, _ = _step_sets(size, batch, 1, 1, 14, mapped)
    assert first + second + third == straight


def test_a_ranks_memory_does_not_grow_with_a_billion_windows(tmp_path: Path) -> None:
    seq = 7
    grown = {}
    for windows in (1_000, 1_000_000_000):  # sparse token files: the sizes of a real entry, no tokens on disk
        report = memory_probe(sparse_entry(tmp_path / str(windows), windows, seq), seq)
        assert report["windows"] == windows and report["shape"] == [16, seq]
        grown[windows] = report["grown_kib"]
    # A permutation of 1e9 indices alone would be 8 GB; the growth is the same few MB either way.
    assert grown[1_000_000_000] - grown[1_000] < 32 * 1024, grown


def test_a_mixture_uses_each_source_its_weight_times_per_epoch() -> None:
    from ddp_amp.data.mixture import Mixture

    class Tagged(Dataset):
        def __init__(self, tag: str, size: int) -> None:
            self.tag, self.size = tag, size

        def __len__(self) -> int:
            return self.size

        def __getitem__(self, index: int) -> tuple[str, int]:
            if not 0 <= index < self.size:
                raise IndexError(index)
            return self.tag, index

    mixture = Mixture([(Tagged("a", 10), 1.0), (Tagged("b", 8), 2.5), (Tagged("c", 6), 0.5)], seed=4)
    assert len(mixture) == 10 + 20 + 3
    epochs = []
    for epoch in range(4):
        mixture.set_epoch(epoch)
        items = [mixture[i] for i in range(len(mixture))]
        counts = {tag: [index for t, index in items if t == tag] for tag in "abc"}
        assert sorted(counts["a"]) == list(range(10))
        assert all(counts["b"].count(i) in (2, 3) for i in range(8)) and len(counts["b"]) == 20
        assert len(set(counts["c"])) == 3
        epochs.append(sorted(counts["c"]))
    assert len({tuple(chosen) for chosen in epochs}) > 1  # a partly used source shows other windows per epoch
    assert set(epochs[0]) | set(epochs[1]) == set(range(6))  # half in one epoch, the other half in the next
