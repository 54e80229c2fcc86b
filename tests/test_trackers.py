"""Experiment trackers, with the real packages and no network: TensorBoard event files read
back with its EventAccumulator, MLflow's client on a local file store, W&B's offline run
file; a resume continues the same tracker runs; a tracker that fails to start is one line
before step 0, one that fails later is dropped and training goes on."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ddp_amp.errors import UsageError
from ddp_amp.metrics.trackers import TRACKERS_FILE, start_trackers
from tests.multiproc import run_train
from tests.plugins import own_tracker

RECORDS = [{"step": 1, "loss": 2.5, "lr": 0.1}, {"step": 2, "loss": 2.0, "lr": 0.1, "eval_nll": 1.5},
           {"step": 3, "loss": 1.75, "lr": 0.05}]


def _tensorboard(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def _mlflow(run_dir: Path, tag: str) -> tuple[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"]
    history = MlflowClient(saved["tracking_uri"]).get_metric_history(saved["run_id"], tag)
    return saved["run_id"], sorted((metric.step, metric.value) for metric in history)


def _wandb_history(run_dir: Path) -> list[tuple[str, dict[str, float]]]:
    """(run id, logged values) of every history record in the offline run files. The file is
    a log of 32 KiB blocks of chunks (checksum, length, kind) after a 7-byte header, each
    record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, payload = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            payload, pos = payload + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last chunk of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                payload = b""
                if record.WhichOneof("record_type") == "history":
                    items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item}
                    found.append((path.stem.removeprefix("run-"), items))
    return found


def test_each_tracker_gets_the_records_and_a_resume_continues_its_run(tmp_path: Path) -> None:
    config = {"lr": 0.1, "task_opt": ["hidden=16"], "precision": "bf16"}
    trackers = start_trackers(["tensorboard", "mlflow", "wandb"], tmp_path, config, 0, print)
    for record in RECORDS[:2]:
        trackers.log(record, record["step"])
    trackers.finish()
    first_ids = json.loads((tmp_path / TRACKERS_FILE).read_text())
    # A resume from step 1: what the lost attempt wrote past it (step 2) is replaced.
    resumed = start_trackers(["tensorboard", "mlflow", "wandb"], tmp_path, config, 1, print)
    for record in RECORDS[1:]:
        resumed.log(record, record["step"])
    resumed.finish()
    assert json.loads((tmp_path / TRACKERS_FILE).read_text()) == first_ids

    expected = [(r["step"], r["loss"]) for r in RECORDS]
    assert [(s, pytest.approx(v)) for s, v in _tensorboard(tmp_path, "loss")] == expected
    run_id, history = _mlflow(tmp_path, "loss")
    assert run_id == first_ids["mlflow"]["run_id"] and [(s, v) for s, v in history if s != 2] == \
        [e for e in expected if e[0] != 2]
    wandb_runs = _wandb_history(tmp_path)
    assert {run for run, _ in wandb_runs} == {first_ids["wandb"]["id"]}  # one run id, both attempts
    assert [items["loss"] for _, items in wandb_runs] == [2.5, 2.0, 2.0, 1.75]
    assert _tensorboard(tmp_path, "eval_nll") == [(2, 1.5)]


def test_a_tracker_that_cannot_start_is_one_line_and_a_broken_one_is_dropped(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as refused:
        start_trackers(["tests.plugins.own_tracker:json_tracker", "tests.plugins.own_tracker:no_start"],
                       tmp_path, {}, 0, print)
    assert "no route to the tracking server" in str(refused.value) and "\n" not in str(refused.value)
    assert own_tracker.read(tmp_path)[-1] == {"finished": "own-" + tmp_path.name}  # the started one closed
    with pytest.raises(UsageError, match=r"tensorbord.*one of tensorboard, wandb, mlflow"):
        start_trackers(["tensorbord"], tmp_path, {}, 0, print)
    warnings: list[str] = []
    trackers = start_trackers(["tests.plugins.own_tracker:breaks_later"], tmp_path, {}, 0, warnings.append)
    trackers.log(RECORDS[0], 1)
    trackers.log(RECORDS[1], 2)
    assert len(warnings) == 1 and "disk full" in warnings[0] and not trackers.started


def test_a_session_loop_has_the_same_trackers(tmp_path: Path) -> None:
    from ddp_amp import Session

    with Session(device="cpu") as session:
        trackers = session.trackers(["tests.plugins.own_tracker:json_tracker"], tmp_path, {"lr": 0.5})
        trackers.log({"step": 7, "loss": 1.25, "note": "text is not a number"}, 7)
        trackers.finish()
    assert own_tracker.read(tmp_path) == [{"start": 0, "run_id": "own-" + tmp_path.name, "lr": 0.5},
                                          {"step": 7, "loss": 1.25}, {"finished": "own-" + tmp_path.name}]


def _train(run_dir: Path, steps: int, trackers: str, *extra: str, nproc: int = 2):
    return run_train(["--task", "mlp", "--task-opt", "hidden=16", "--task-opt", "samples=256", "--batch-size", "16",
                      "--max-steps", str(steps), "--log-every", "2", "--eval-every", "4", "--tracker", trackers,
                      "--run-dir", str(run_dir), *extra], nproc=nproc)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run to step 4 (profiling steps 2-3), resumed to step 8."""
    run_dir = tmp_path_factory.mktemp("tracked")
    trackers = "tensorboard,tests.plugins.own_tracker:json_tracker"
    first = _train(run_dir, 4, trackers, "--profile-steps", "2:3")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "top ops per step over 2 step(s)" in first.stdout and "profile of steps 2-3" in first.stdout
    again = _train(run_dir, 8, trackers)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-2000:]
    return run_dir


def test_a_two_rank_run_and_its_resume_log_to_one_tracker_run_from_rank_0(two_rank_run: Path) -> None:
    records = [json.loads(line) for line in (two_rank_run / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [step for step, _ in losses] == [2, 4, 6, 8]
    assert [(s, pytest.approx(v)) for s, v in _tensorboard(two_rank_run, "loss")] == losses
    evals = [(r["step"], r["eval_mse"]) for r in records if "eval_mse" in r]
    assert [(s, pytest.approx(v)) for s, v in _tensorboard(two_rank_run, "eval_mse")] == evals and len(evals) == 3
    own = own_tracker.read(two_rank_run)
    starts = [line for line in own if "start" in line]
    # rank 0 only, once per launch, and the second launch continued the first one's run
    name = "own-" + two_rank_run.name
    assert [(s["start"], s["run_id"]) for s in starts] == [(0, name), (4, name)]
    assert [line["step"] for line in own if "loss" in line] == [2, 4, 6, 8]


def test_the_profile_window_left_a_trace_per_rank_that_parses(two_rank_run: Path) -> None:
    traces = sorted((two_rank_run / "profile").glob("rank*.pt.trace.json"))
    assert [trace.name.split(".")[0] for trace in traces] == ["rank0", "rank1"]  # one each, the resume none
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
        assert len(steps) == 2 and any(event.get("name") == "aten::addmm" for event in events), trace


def test_a_tracker_that_fails_to_start_stops_the_run_before_step_0(tmp_path: Path) -> None:
    result = _train(tmp_path, 4, "tests.plugins.own_tracker:no_start", nproc=0)
    errors = [line for line in result.stderr.splitlines() if line.startswith("ddp_amp: error:")]
    assert result.returncode != 0 and len(errors) == 1 and "no route to the tracking server" in errors[0]
    assert not list(tmp_path.glob("checkpoints/step-*")) and not (tmp_path / "metrics.jsonl").exists()
