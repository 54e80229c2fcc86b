"""Loss-scale safety: hysteresis and floor in the scaler, the guard that stops a failing run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.command_line import parse_command_line
from ddp_amp.errors import TrainingHalted, UsageError
from ddp_amp.amp import LossScaleOptions, next_scale
from ddp_amp.guards import LossScaleGuard
from ddp_amp.amp import AgreedGradScaler
from ddp_amp.train import train
from ddp_amp.trainer import session_for
from tests.multiproc import run_train


def _step(scaler: AgreedGradScaler, param: torch.nn.Parameter, overflow: bool) -> None:
    optimizer = torch.optim.SGD([param], lr=0.0)
    loss = (param * (float("inf") if overflow else 1.0)).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    param.grad = None


def test_hysteresis_tolerates_overflows_then_backs_off_to_the_floor() -> None:
    scaler = AgreedGradScaler("cpu", init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    param = torch.nn.Parameter(torch.ones(3))
    scales = []
    for overflow in [True, True, True, False, True, False, False, True, True, True, True]:
        _step(scaler, param, overflow)
        scales.append(scaler.get_scale())
    # 1st overflow tolerated, 2nd and 3rd back off; a clean step resets the count so the
    # next single overflow is tolerated again; two clean steps grow; the floor holds at 2.
    assert scales == [8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 2.0, 2.0, 2.0]
    assert int(scaler.skipped_steps()) == 8


def test_default_options_behave_like_plain_gradscaler() -> None:
    plain = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
    ours = AgreedGradScaler("cpu", init_scale=16.0, growth_interval=2)
    # A floor far below reach changes nothing: same scales.
    policy = AgreedGradScaler("cpu", init_scale=16.0, growth_interval=2, min_scale=1e-30)
    for overflow in [True, False, False, True, True, False, False, False]:
        for scaler in (plain, ours, policy):
            _step(scaler, torch.nn.Parameter(torch.ones(2)), overflow)  # type: ignore[arg-type]
        assert ours.get_scale() == plain.get_scale() == policy.get_scale()
    assert plain.get_scale() == 8.0  # 16 -> 8 -> 16 -> 8 -> 4 -> 4 -> 8 -> 8


def test_floor_without_hysteresis_follows_the_reference_rule() -> None:
    # hysteresis 1 takes torch's fused update plus a clamp; next_scale is the rule it must match.
    scaler = AgreedGradScaler("cpu", init_scale=16.0, growth_interval=2, min_scale=2.0)
    scale, tracker, streak = torch.tensor(16.0), torch.tensor(0, dtype=torch.int32), 0
    generator = torch.Generator().manual_seed(0)
    overflows = [True] * 5 + (torch.rand(40, generator=generator) < 0.3).tolist()
    seen = []
    for overflow in overflows:
        _step(scaler, torch.nn.Parameter(torch.ones(2)), overflow)
        streak = streak + 1 if overflow else 0
        scale, tracker = next_scale(scale, tracker, torch.tensor(streak), 2.0, 0.5, 2, 1, 2.0)
        seen.append(scaler.get_scale())
        assert seen[-1] == float(scale)
    assert seen[:5] == [8.0, 4.0, 2.0, 2.0, 2.0] and max(seen) > 2.0  # held at the floor, then grew


def test_guard_stops_after_consecutive_skips_and_streak_survives_state_dict() -> None:
    options = LossScaleOptions(init_scale=2.0**10, min_scale=0.0, max_consecutive_skips=3)
    scaler = AgreedGradScaler("cpu", **options.scaler_kwargs())  # type: ignore[arg-type]
    guard = LossScaleGuard(options)
    param = torch.nn.Parameter(torch.ones(2))
    for _ in range(2):
        _step(scaler, param, True)
    guard.check(scaler, 2)  # 2 < 3: carry on
    restored = AgreedGradScaler("cpu", **options.scaler_kwargs())  # type: ignore[arg-type]
    restored.load_state_dict(scaler.state_dict())
    _step(restored, param, True)
    with pytest.raises(TrainingHalted, match=r"3 consecutive.*--precision bf16"):
        guard.check(restored, 3)


def test_bad_loss_scale_options_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="--loss-scale-backoff"):
        _ = parse_command_line(["--loss-scale-backoff", "1.5"]).config
    with pytest.raises(UsageError, match="--loss-scale-min"):
        _ = parse_command_line(["--loss-scale-min", "1e9"]).config
    with pytest.raises(UsageError, match="--check-sync-every"):
        _ = parse_command_line(["--check-sync-every", "-1"]).config


def _one_process(tmp_path: Path, **options: object) -> TrainConfig:
    return TrainConfig(task="tests.plugins.nonfinite_task:make_task", run_dir=str(tmp_path), max_steps=30,
                       batch_size=16, log_every=5, device="cpu", **options)  # type: ignore[arg-type]


def test_scale_at_floor_with_overflows_stops_one_process(tmp_path: Path) -> None:
    config = _one_process(tmp_path, precision="fp16", loss_scale_init=4.0, loss_scale_min=1.0,
                          task_opt=("poison=0.weight", "from_step=2"))
    with pytest.raises(TrainingHalted, match=r"floor 1 .*--precision bf16"):
        with session_for(config) as session:
            train(config, session)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    overflows = [e for e in events if e.get("event") == "overflow"]
    # 4 -> 2 -> 1 (floor), then overflows at the floor from step 4 on; the counters are read
    # every log_every (5) steps, so the stop comes at the first check after: step 5.
    assert events[-1]["event"] == "halted" and events[-1]["step"] == 5
    # One process: the skipped step's gradients are its own, so the first report names them.
    assert overflows and overflows[0]["ranks"] == [0] and overflows[0]["params"] == {"0": ["0.weight"]}
    assert not (tmp_path / "summary.json").exists()


def test_nonfinite_loss_stops_fp32_at_the_next_log_step(tmp_path: Path) -> None:
    config = _one_process(tmp_path, precision="fp32", task_opt=("poison=loss", "from_step=7"))
    with pytest.raises(TrainingHalted, match=r"loss is nan at step 10"):
        with session_for(config) as session:
            train(config, session)


def test_two_ranks_fp16_stop_and_name_the_rank_with_bad_local_gradients(tmp_path: Path) -> None:
    result = run_train(["--device", "cpu", "--precision", "fp16", "--task", "tests.plugins.nonfinite_task:make_task",
                        "--task-opt", "poison=2.bias", "--task-opt", "bad_rank=1", "--task-opt", "from_step=3",
                        "--max-consecutive-skips", "5", "--max-steps", "60", "--batch-size", "16",
                        "--log-every", "50", "--run-dir", str(tmp_path)], nproc=2)
    assert result.returncode != 0
    # Skips from step 3 on; the counters are read every 2 steps (half the limit), so the
    # streak is seen at 6 consecutive skips, at step 8.
    assert result.stderr.count("ddp_amp: stopped: fp16 loss scaling failed at step 8: 6 consecutive "
                               "optimizer steps were skipped") == 1  # once, from rank 0
    assert "--precision bf16" in result.stderr and "lower --lr" in result.stderr
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    overflows = [e for e in events if e.get("event") == "overflow"]
    # The first check that sees skips (step 4) arms the probe: that report names nobody...
    assert overflows[0]["step"] == 4 and not overflows[0]["checked"] and overflows[0]["ranks"] == []
    # ...and every later one names rank 1's own bad gradient, before DDP's reduction spread it.
    assert len(overflows) >= 2, overflows
    assert all(e["checked"] and e["ranks"] == [1] and e["params"] == {"1": ["2.bias"]}
               for e in overflows[1:]), overflows
    assert sum(e["skipped"] for e in overflows) == 6  # every skip is accounted for
    assert events[-1] == {**events[-1], "event": "halted", "step": 8}
    # no checkpoint of the bad state (the folder itself is made by the writability check)
    assert not (tmp_path / "summary.json").exists() and not list(tmp_path.glob("checkpoints/step-*"))
    assert os.listdir(tmp_path)  # the run dir (config, metrics) is kept for the post-mortem


def _scaler_settings(scaler: AgreedGradScaler) -> dict[str, float | int]:
    return {"init_scale": scaler.get_scale(), "growth_interval": scaler.get_growth_interval(),
            "backoff_factor": scaler.get_backoff_factor(), "min_scale": scaler.min_scale,
            "hysteresis": scaler.hysteresis}


def test_a_session_and_the_command_line_start_from_the_same_loss_scale_settings() -> None:
    """A `Session` with no scaler options gets the `--loss-scale-*` defaults, floor included,
    both from `LossScaleOptions`; an option a caller names replaces only that one."""
    from ddp_amp.session import Session

    cli = session_for(parse_command_line(["--precision", "fp16", "--device", "cpu"]).config)
    with cli:
        from_cli = _scaler_settings(cli.scaler)
    with Session("fp16", "cpu", environ={}) as session:
        assert _scaler_settings(session.scaler) == from_cli == LossScaleOptions().scaler_kwargs()
    assert from_cli["min_scale"] == TrainConfig().loss_scale_min == 1.0
    with Session("fp16", "cpu", scaler_options={"init_scale": 512.0}, environ={}) as session:
        assert _scaler_settings(session.scaler) == {**from_cli, "init_scale": 512.0}
