"""--activation-checkpointing none | full | selective under --shard: the flag alone still means
full (and an older run's or a config file's `true`), selective keeps the matmul and attention
outputs and recomputes the rest, and all three train to the same losses, bit for bit in fp32
(the recompute replays the same ops, dropout included), on 2 real gloo ranks. A selective
run's checkpoint resumes without checkpointing, on another world size. A profiler annotation
that only the recompute meets (FSDP's input cast with bf16 gathers) is let through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_amp import UsageError
from ddp_amp.command_line import parse_command_line
from ddp_amp.config import same_setting
from ddp_amp.parallel import ParallelPlan, ShardOptions
from ddp_amp.parallel.recompute import checkpoint_units
from tests.multiproc import run_train
from tests.test_shard import LM
from tests.torch_features import needs_sharding

pytestmark = needs_sharding


@pytest.mark.parametrize("argv, mode", [
    (["--shard"], "none"),
    (["--shard", "--activation-checkpointing"], "full"),
    (["--shard", "--activation-checkpointing", "--max-steps", "3"], "full"),
    (["--shard", "--activation-checkpointing", "selective"], "selective"),
    (["--shard", "--activation-checkpointing=full"], "full"),
    (["--shard", "--activation-checkpointing", "selective", "--no-activation-checkpointing"], "none"),
])
def test_the_flag_alone_means_full_and_takes_a_mode(argv: list[str], mode: str) -> None:
    assert parse_command_line(argv).config.activation_checkpointing == mode


def test_a_config_files_switch_and_an_older_runs_boolean_keep_their_meaning(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    for text, mode in (("true", "full"), ("false", "none"), ('"selective"', "selective")):
        path.write_text(f"shard = true\nactivation_checkpointing = {text}\n")
        assert parse_command_line(["--config", str(path)]).config.activation_checkpointing == mode
    # config.json of a run from before the modes recorded a boolean: the same setting, no notice on resume
    assert same_setting("activation_checkpointing", False, "none")
    assert same_setting("activation_checkpointing", True, "full")
    assert not same_setting("activation_checkpointing", True, "selective")
    # Session and plan take the old booleans too
    assert ShardOptions(activation_checkpointing=True).activation_checkpointing == "full"
    assert ParallelPlan(shard=True, activation_checkpointing=False).activation_checkpointing == "none"


def test_a_bad_mode_is_one_line_naming_it_and_the_choices(tmp_path: Path) -> None:
    for argv, named in ((["--shard", "--activation-checkpointing", "some"], "some"),
                        (["--activation-checkpointing", "selective"], "--shard")):
        with pytest.raises(UsageError) as refused:
            parse_command_line(argv)
        message = str(refused.value)
        assert "\n" not in message and "--activation-checkpointing" in message and named in message, message
    with pytest.raises(UsageError) as refused:
        ShardOptions(activation_checkpointing="partial")
    assert "partial" in str(refused.value) and "selective" in str(refused.value)


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def test_every_mode_trains_to_the_same_losses_and_a_selective_checkpoint_resumes_without(tmp_path: Path) -> None:
    losses: dict[str, dict[int, float]] = {}
    for mode in ("none", "full", "selective"):
        result = run_train([*LM, "--shard", "--activation-checkpointing", mode, "--max-steps", "4",
                            "--ckpt-every", "2", "--run-dir", str(tmp_path / mode)], nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        described = {"none": "root run_dir", "full": "(activation checkpointing per unit)",
                     "selective": "(selective activation checkpointing per unit)"}[mode]
        assert described in result.stdout
        losses[mode] = _losses(tmp_path / mode)
    assert len(losses["none"]) == 4 and losses["full"] == losses["none"] and losses["selective"] == losses["none"]

    # The selective run's step-2 checkpoint, resumed without checkpointing on one rank: the
    # names are the model's own, so it loads and trains on.
    step2 = tmp_path / "selective" / "checkpoints" / "step-00000002"
    resumed = run_train([*LM, "--shard", "--max-steps", "4", "--resume", str(step2),
                         "--run-dir", str(tmp_path / "resumed")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(_losses(tmp_path / "resumed")) == [3, 4]


class _AnnotatedInRecompute(nn.Module):
    """What FSDP2's pre-forward hook does with bf16 gathers: a profiler annotation that the
    recompute runs inside the checkpointed region and the forward ran before it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.recomputing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recomputing:  # the inputs are bf16 already then: the cast under it does nothing
            with torch.profiler.record_function("FSDP::cast_forward_inputs"):
                pass
        return torch.relu(self.linear(x)).square()


def test_selective_recompute_lets_through_an_annotation_only_the_recompute_meets() -> None:
    torch.manual_seed(0)
    plain, checkpointed = _AnnotatedInRecompute(), _AnnotatedInRecompute()
    checkpointed.load_state_dict(plain.state_dict())
    checkpoint_units([checkpointed], "selective")
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    out = checkpointed(x)
    checkpointed.recomputing = True
    out.sum().backward()  # torch 2.13 alone: "record_function... encountered during backward but not found"
    for theirs, ours in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(theirs.grad, ours.grad)
