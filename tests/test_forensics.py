"""Overflow forensics names the rank whose own gradients went non-finite, after the user's hooks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ddp_amp.guards import OverflowProbe
from tests.multiproc import run_train


def _backward(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 4)).sum().backward()


def test_the_armed_check_runs_after_hooks_registered_later_and_disarmed_it_checks_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    probe = OverflowProbe(list(model.named_parameters()), rank=0)
    probe.arm()

    def write_nan(param: torch.Tensor) -> None:
        param.grad.fill_(float("nan"))  # type: ignore[union-attr]
    late = model[1].bias.register_post_accumulate_grad_hook(write_nan)  # after the probe armed
    _backward(model)
    found = probe.report(step=1, skipped=1)
    assert found["checked"] and found["ranks"] == [0] and found["params"] == {"0": ["1.bias"]}, found
    probe.disarm()
    _backward(model)  # disarmed: nothing checks, nothing is recorded
    assert probe.report(step=2, skipped=1)["checked"] is False
    late.remove()


def test_a_nan_from_the_users_own_hooks_is_named_whenever_they_were_registered(tmp_path: Path) -> None:
    # Rank 1's hooks write NaN into 0.weight (a hook registered when the task is built, before
    # the probe arms) and into 2.bias (a hook registered anew on every step, after it arms)
    # at steps 3, 7 and 8. Counters are read every 2 steps: step 4 sees the first skip and
    # arms the probe, step 8 sees the next two.
    result = run_train(["--device", "cpu", "--precision", "fp16", "--task", "tests.plugins.hooked_nan_task:make_task",
                        "--task-opt", "bad_rank=1", "--task-opt", "steps=3,7,8", "--task-opt", "build=0.weight",
                        "--task-opt", "every_step=2.bias", "--max-steps", "10", "--batch-size", "16",
                        "--log-every", "2", "--run-dir", str(tmp_path)], nproc=2)
    assert result.returncode == 0, result.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    overflows = [e for e in events if e.get("event") == "overflow"]
    assert [(e["step"], e["skipped"], e["checked"]) for e in overflows] == [(4, 1, False), (8, 2, True)], overflows
    # The probe saw each gradient after every hook of the user, before DDP's reduction mixed them.
    assert overflows[1]["ranks"] == [1] and sorted(overflows[1]["params"]["1"]) == ["0.weight", "2.bias"], overflows
    assert "non-finite local gradients on rank(s) [1] (rank 1: " in result.stdout
