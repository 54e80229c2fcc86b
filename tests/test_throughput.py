"""The log's throughput fields: tokens/s from the task's tokens per sample, achieved TFLOP/s
from the counted FLOPs, MFU only against a known GPU peak (never on a CPU; test_peaks.py
has the peaks and the exact division)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddp_amp.metrics import counting_flops, dense_peak_tflops, throughput_fields
from tests.multiproc import cli_env, run_train


def test_fields_follow_their_inputs_and_a_cpu_gets_no_mfu() -> None:
    fields = throughput_fields(4e12, 2.0, 100.0, 35, torch.device("cpu"), "bf16")
    assert fields["tokens_per_s"] == 3500.0 and fields["tflops"] == 2.0 and fields["mem_mb"] > 0
    assert "mfu" not in fields
    untokened = throughput_fields(None, 2.0, 100.0, 0, torch.device("cpu"), "fp32")
    assert set(untokened) == {"mem_mb"}  # nothing counted, no tokens: nothing made up


def test_the_counted_flops_of_a_linear_step_are_its_matmuls() -> None:
    layer = torch.nn.Linear(64, 32)
    inputs = torch.randn(16, 64)
    _, flops = counting_flops(lambda: layer(inputs).sum().backward())
    # forward x W^T and the weight's gradient; the input needs no gradient
    assert flops == 2 * (2 * 16 * 64 * 32)


@pytest.mark.cuda
def test_a_gpu_run_logs_mfu_against_its_listed_peak(tmp_path: Path) -> None:
    result = run_train(["--task", "lm", "--precision", "bf16", "--max-steps", "20", "--log-every", "10",
                        "--run-dir", str(tmp_path)], env=cli_env(gpus=True), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    peak = dense_peak_tflops(torch.device("cuda"), "bf16")
    if peak is None:
        pytest.skip(f"no dense peak is listed for {torch.cuda.get_device_name()}")
    assert logged and all(0 < r["mfu"] <= 1 and r["mfu"] == pytest.approx(r["tflops"] / peak) for r in logged), logged
