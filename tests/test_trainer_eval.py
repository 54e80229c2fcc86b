"""`--eval-every`: the held-out metric before training and every N steps, reduced over ranks."""

from __future__ import annotations

from dataclasses import replace

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.command_line import parse_command_line
from ddp_amp.distributed import DistContext, init_distributed
from ddp_amp.env import detect_env
from ddp_amp.errors import UsageError
from ddp_amp.metrics import QuietRunLog
from ddp_amp.tasks import load_task
from ddp_amp.trainer import Trainer, seed_everything, session_for
from tests.multiproc import run_ranks, run_train

# The example plugin: 2048 points, 409 held out (odd, so 2 ranks cannot split it evenly).
RINGS = ["--task", "examples.plugin_task:make_task", "--batch-size", "32"]


def read_records(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "summary" not in r], json.loads((run_dir / "summary.json").read_text())


def untrained_metrics(ctx: DistContext, argv: list[str]) -> dict[str, float]:
    """evaluate() of a freshly built task on this rank's world (collective)."""
    config = parse_command_line(argv).config
    seed_everything(config.seed)
    task = load_task(config.task, config)
    trainer = Trainer(session_for(replace(config, precision="fp32")).start(), config, task, QuietRunLog(ctx.rank))
    return trainer.evaluate()


@pytest.mark.parametrize("argv", [RINGS, ["--task", "lm", "--batch-size", "32", "--task-opt", "emsize=16",
                                          "--task-opt", "nhid=16", "--task-opt", "vocab=100",
                                          "--task-opt", "tokens=8000"],
                                  # 400 words hold out one chunk: rank 1 has nothing to score
                                  ["--task", "lm", "--batch-size", "4", "--task-opt", "emsize=16",
                                   "--task-opt", "nhid=16", "--task-opt", "vocab=50", "--task-opt", "tokens=400"]])
def test_two_ranks_score_every_held_out_item_once(argv: list[str]) -> None:
    single = untrained_metrics(init_distributed(detect_env({}), device="cpu"), argv)
    both = run_ranks(untrained_metrics, 2, argv)
    assert both[0] == both[1]  # every rank reports the reduced result
    assert single.keys() == both[0].keys() and single
    for name, value in single.items():  # a padded or dropped item would move these
        assert both[0][name] == pytest.approx(value, rel=1e-6), name  # fp32 sums, other batch splits


def test_default_run_trains_lm_and_its_held_out_perplexity_falls(tmp_path: Path) -> None:
    result = run_train(["--max-steps", "20", "--eval-every", "10", "--log-every", "10",
                        "--run-dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    records, summary = read_records(tmp_path)
    evals = [r for r in records if "eval_ppl" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert summary["eval_ppl"] == evals[-1]["eval_ppl"]  # the summary reuses the step-20 metric
    assert evals[-1]["eval_ppl"] < evals[0]["eval_ppl"] / 2, evals
    assert "task=lm" in result.stdout
    # Throughput: tokens are the task's bptt (35) per sample; the model FLOPs counted on the
    # first step are near the 6 x parameters x tokens rule (the embedding lookup does none,
    # attention adds a little); a CPU has no known peak, so no MFU.
    logged = [r for r in records if "loss" in r]
    assert all(r["tokens_per_s"] == pytest.approx(35 * r["samples_per_s"]) for r in logged)
    assert all(r["tflops"] > 0 and r["mem_mb"] > 0 and "mfu" not in r for r in logged)
    weights = torch.load(tmp_path / "checkpoints" / "step-00000020" / "model.pt", weights_only=True)
    params = sum(t.numel() for name, t in weights.items() if "embed" not in name and t.is_floating_point())
    rule = 6 * params * 64 * 35
    assert 0.8 < summary["flops_per_step"] / rule < 1.3, (summary["flops_per_step"], rule, sorted(weights))


def test_eval_every_is_validated() -> None:
    with pytest.raises(UsageError, match="--eval-every"):
        TrainConfig(eval_every=-1)
    assert parse_command_line(["--eval-every", "0"]).config.eval_every == 0


def test_evaluating_does_not_change_the_training_trajectory() -> None:
    """Eval draws no numbers from the global RNG, so dropout after it is the same as without it."""
    argv = ["--task", "lm", "--batch-size", "8", "--max-steps", "6", "--task-opt", "emsize=16",
            "--task-opt", "nhid=16", "--task-opt", "vocab=100", "--task-opt", "tokens=4000",
            "--task-opt", "dropout=0.3"]
    losses = []
    for every in ("0", "2"):
        config = parse_command_line([*argv, "--eval-every", every]).config
        config = replace(config, precision="fp32", device="cpu")
        with session_for(config) as session:
            seed_everything(config.seed)
            task = load_task(config.task, config)
            losses.append(Trainer(session, config, task, QuietRunLog(1)).fit()["loss"])
    assert losses[0] == losses[1]
