"""Iterable (streaming) training data: every item is used once per pass by one rank and one
worker, passes follow one another, and a resume continues bit for bit (2 ranks, 2 workers)."""

from __future__ import annotations

from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from ddp_amp.data.iterable_stream import RankShard, iterable_stream
from tests.multiproc import run_train
from tests.plugins.stream_task import TeacherStream

PLUGIN = "tests.plugins.stream_task:make_task"


def _firsts(dataset: RankShard, workers: int) -> list[float]:
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers)
    return [x[0].item() for x, _ in loader]


def test_ranks_and_workers_share_out_each_item_once() -> None:
    stream = TeacherStream(40)
    everything = sorted(x[0].item() for x, _ in stream)
    shares = [_firsts(RankShard(stream, rank, 2), workers=2) for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == everything  # all of them, none twice
    assert abs(len(shares[0]) - len(shares[1])) <= 1


def test_passes_follow_one_another_and_the_position_resumes_mid_pass() -> None:
    stream = iterable_stream(TeacherStream(20), 4, rank=0, world_size=1, device=torch.device("cpu"))
    seen = [next(stream)[0] for _ in range(7)]  # 5 batches a pass: the 6th starts pass 1
    assert stream.epoch == 1 and stream.batch_in_epoch == 2
    assert torch.equal(seen[5], seen[0]) and torch.equal(seen[6], seen[1])
    again = iterable_stream(TeacherStream(20), 4, rank=0, world_size=1, device=torch.device("cpu"))
    again.load_state_dict(stream.state_dict())
    assert torch.equal(next(again)[0], seen[2]) and again.epoch == 1


def test_the_stream_leaves_the_global_rng_alone() -> None:
    # A loader's iterator draws its base seed from the global RNG unless it is kept apart: a
    # resumed run makes it at another step, and every later dropout mask would shift.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    stream = iterable_stream(TeacherStream(20), 4, rank=0, world_size=1, device=torch.device("cpu"))
    stream.state_dict()
    [next(stream) for _ in range(7)]  # across a pass boundary: a second iterator
    stream.load_state_dict(stream.state_dict())
    next(stream)
    assert torch.equal(torch.get_rng_state(), before)


def _run(run_dir: Path, steps: int, nproc: int = 2):
    return run_train(["--task", PLUGIN, "--batch-size", "16", "--num-workers", "2", "--max-steps", str(steps),
                      "--optimizer", "sgd", "--precision", "fp32", "--log-every", "4", "--run-dir", str(run_dir)],
                     nproc=nproc, timeout=240)


def test_a_streamed_run_resumes_bitwise_on_two_ranks_with_workers(tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    # 200 items: 100 per rank, 12 batches of 8 per pass; 16 steps cross into the second pass.
    assert _run(straight, 16).returncode == 0
    first = _run(halves, 9)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _run(halves, 16)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout
    load = lambda run, name: torch.load(run / "checkpoints" / "step-00000016" / name, weights_only=True)  # noqa: E731
    a, b = load(straight, "model.pt"), load(halves, "model.pt")
    assert all(torch.equal(a[name], b[name]) for name in a)
    positions = [load(straight, f"per_rank/rank-0000{rank}.pt") for rank in (0, 1)]  # each rank's own file
    assert all(set(own) == {"data"} and own["data"]["epoch"] == 1 for own in positions)
    assert positions[0]["data"] != positions[1]["data"]  # each its own stream's position, not a list of all
    other = _run(halves, 20, nproc=0)
    assert other.returncode == 2 and "the data position is per rank" in other.stderr
