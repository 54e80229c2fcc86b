"""Mixed precision reaches the fp32 metric: same seed, same steps, fp32 vs bf16 vs fp16.

Short CPU runs of tiny models (bf16/fp16 run 4-10x slower than fp32 on a CPU without
low-precision units); the longer runs behind the table in docs/parity.md use the CLI.
Tolerances are the issue's: accuracy within 0.5 points, perplexity within 2%.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ddp_amp.command_line import parse_command_line
from ddp_amp.metrics import QuietRunLog
from ddp_amp.tasks import load_task
from ddp_amp.trainer import Trainer, seed_everything, session_for

# A 1-layer, 32-wide LM on a 20k-word slice. At this size SGD at lr >= 2 is chaotic: any
# rounding difference grows step by step, so the final perplexity depends on which seed
# and machine ran it, not on the precision. Measured on 80-step runs, seeds 0-3: at lr 5,
# gaps of 3-20%; at lr 2, bf16/fp16 vs fp32 from -2.8% to +4.4% (only seeds 0 and 1 were
# inside 2%); at lr 1, at most 0.1%, also with 2 threads. The longer runs in docs/parity.md
# use the recipe's lr 5.0 and hold the gaps against a control run.
LM_ARGS = ["--task", "lm", "--max-steps", "80", "--batch-size", "16", "--lr", "1",
           "--task-opt", "emsize=32", "--task-opt", "nhid=32", "--task-opt", "nlayers=1",
           "--task-opt", "vocab=300", "--task-opt", "tokens=20000", "--task-opt", "bptt=16",
           "--task-opt", "dropout=0"]
DIGITS_ARGS = ["--task", "digits", "--max-steps", "300", "--task-opt", "hidden=64"]


def final_summary(argv: list[str], precision: str) -> dict[str, Any]:
    """Train one process on the CPU with `precision`; return the run's summary."""
    config = parse_command_line([*argv, "--precision", precision, "--eval-every", "0", "--log-every", "1000"]).config
    with session_for(config) as session:
        seed_everything(config.seed)
        task = load_task(config.task, config)
        return Trainer(session, config, task, QuietRunLog(1)).fit()


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores, shared by every test process
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", [0, 1])
def test_lm_perplexity_in_bf16_and_fp16_is_within_2_percent_of_fp32(seed: int) -> None:
    args = [*LM_ARGS, "--seed", str(seed)]
    reference = final_summary(args, "fp32")
    assert reference["eval_ppl"] < 80  # it learned (a uniform guess over 300 words is 300)
    for precision in ("bf16", "fp16"):
        summary = final_summary(args, precision)
        assert summary["precision"] == precision
        gap = abs(summary["eval_ppl"] / reference["eval_ppl"] - 1)
        assert gap < 0.02, (precision, summary["eval_ppl"], reference["eval_ppl"])


def test_digits_accuracy_in_bf16_and_fp16_is_within_half_a_point_of_fp32() -> None:
    pytest.importorskip("sklearn", reason="the digits task needs the [sklearn] extra (in [test])")
    reference = final_summary(DIGITS_ARGS, "fp32")
    assert reference["eval_accuracy"] > 0.9
    for precision in ("bf16", "fp16"):
        summary = final_summary(DIGITS_ARGS, precision)
        assert summary["precision"] == precision
        gap_points = abs(summary["eval_accuracy"] - reference["eval_accuracy"]) * 100
        assert gap_points <= 0.5, (precision, summary["eval_accuracy"], reference["eval_accuracy"])
