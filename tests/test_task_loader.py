"""A task's own training loader (`Task.make_loader`): shuffled afresh each pass, resumed
bitwise with 2 workers across pass boundaries (its per-pass LR too), and refused in one
line where a resume could not trust it (2 ranks whose passes differ in length)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddp_amp import DistContext, DistEnv, LoaderRequest, UsageError
from ddp_amp.data.loader_stream import LoaderStream
from ddp_amp.data.task_loader import task_loader_stream
from tests.multiproc import run_train
from tests.plugins import own_loader_task

PLUGIN = "tests.plugins.own_loader_task"
ONE_PROCESS = DistContext(DistEnv(), torch.device("cpu"), None)


def _request(micro_batch_size: int = 8) -> LoaderRequest:
    return LoaderRequest(rank=0, world_size=1, micro_batch_size=micro_batch_size, num_workers=0, seed=3,
                         device=torch.device("cpu"), worker_init_fn=lambda worker: None)


def test_each_pass_is_shuffled_afresh_and_a_position_resumes_mid_pass() -> None:
    stream = LoaderStream(own_loader_task.stateful_loader(_request()), 8, torch.device("cpu"), "test")
    seen = [next(stream)[0] for _ in range(15)]  # 96 items: 12 batches a pass
    first_pass, second_pass = torch.cat(seen[:3]), torch.cat(seen[12:15])
    assert stream.epoch == 1 and not torch.equal(first_pass, second_pass)
    again = LoaderStream(own_loader_task.stateful_loader(_request()), 8, torch.device("cpu"), "test")
    saved = {**stream.state_dict()}
    expected = next(stream)[0]
    again.load_state_dict(saved)
    assert torch.equal(next(again)[0], expected) and again.epoch == 1


def test_a_loader_without_a_position_is_refused_in_one_line() -> None:
    task = own_loader_task.plain_loader(None)  # type: ignore[arg-type]
    with pytest.raises(UsageError) as refused:
        task_loader_stream(task.make_loader, task.schedule_on, ONE_PROCESS, torch.device("cpu"), 8, 0, 0,
                           lambda worker: None)
    assert "DataLoader" in str(refused.value) and "StatefulDataLoader" in str(refused.value)
    assert "\n" not in str(refused.value)


def _run(run_dir: Path, steps: int, factory: str = "make_task", nproc: int = 2):
    return run_train(["--task", f"{PLUGIN}:{factory}", "--batch-size", "16", "--num-workers", "2", "--max-steps",
                      str(steps), "--optimizer", "sgd", "--precision", "fp32", "--log-every", "1",
                      "--run-dir", str(run_dir)], nproc=nproc, timeout=240)


def _lrs(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def test_an_own_loader_resumes_bitwise_with_workers_across_passes(tmp_path: Path) -> None:
    # One process: the loader's state is per rank, and two ranks' positions in one checkpoint
    # are tests/test_iterable_stream.py's (the same stream class under an iterable dataset).
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    # 96 items in micro-batches of 16: 6 steps a pass; 14 steps start a third pass.
    assert _run(straight, 14, nproc=0).returncode == 0
    first = _run(halves, 8, nproc=0)  # stops in the second pass
    assert first.returncode == 0, first.stderr[-2000:]
    again = _run(halves, 14, nproc=0)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-2000:]
    load = lambda run, name: torch.load(run / "checkpoints" / "step-00000014" / name, weights_only=True)  # noqa: E731
    a, b = load(straight, "model.pt"), load(halves, "model.pt")
    assert all(torch.equal(a[name], b[name]) for name in a)
    lrs = _lrs(straight)
    assert {step: lr for step, lr in _lrs(halves).items() if step > 8} == {s: lr for s, lr in lrs.items() if s > 8}
    assert sorted({lr for lr in lrs.values()}, reverse=True) == [0.05, 0.025, 0.0125]  # halved after each pass
    assert load(straight, "per_rank/rank-00000.pt")["data"]["epoch"] == 2  # the one rank's own position


def test_ranks_whose_passes_differ_in_length_are_refused_a_per_pass_schedule(tmp_path: Path) -> None:
    result = _run(tmp_path / "uneven", 4, "uneven_loader")
    assert result.returncode != 0 and not list((tmp_path / "uneven").glob("checkpoints/step-*"))
    message = [line for line in result.stderr.splitlines() if "Task.schedule_on" in line]
    assert message and "6, 9" in message[0], result.stderr[-2000:]
