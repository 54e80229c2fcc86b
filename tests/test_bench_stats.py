"""Paired ratios and the interleaving order of the benchmark (in-process, no timing targets)."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_amp.bench.stats import interleave, paired_ratio, quantile
from ddp_amp.errors import UsageError
from ddp_amp.parallel import comm_hook


def test_paired_ratio_is_the_median_of_per_block_ratios_with_its_spread() -> None:
    a = [1.0, 2.0, 4.0, 1.0]
    b = [1.1, 2.0, 4.8, 0.9]  # ratios 1.1, 1.0, 1.2, 0.9
    ratio = paired_ratio(a, b)
    assert ratio["median"] == pytest.approx(1.05)
    assert (ratio["min"], ratio["max"], ratio["pairs"]) == (pytest.approx(0.9), pytest.approx(1.2), 4)
    assert ratio["q1"] == pytest.approx(quantile([1.1, 1.0, 1.2, 0.9], 0.25))
    assert math.isnan(paired_ratio([], [])["median"])


def test_interleave_alternates_and_flips_the_order_every_round() -> None:
    calls: list[str] = []
    times = interleave([lambda: calls.append("a"), lambda: calls.append("b")], 3, 2, torch.device("cpu"))
    assert calls == list("aabb" "bbaa" "aabb")
    assert [len(t) for t in times] == [3, 3] and all(x >= 0 for t in times for x in t)


def test_grad_comm_dtype_hooks() -> None:
    assert comm_hook("fp32") is None
    assert comm_hook("bf16", "gloo") is not None and comm_hook("fp16", "nccl") is not None
    with pytest.raises(UsageError):
        comm_hook("fp8")
