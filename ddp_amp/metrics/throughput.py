"""Model FLOPs, tokens and device memory for each log line.

The FLOPs of one training step are counted once, on the first step this process runs, by
running that step under torch's `FlopCounterMode` (matmuls, convolutions and attention,
forward and backward; the optimizer's elementwise work is not counted, as MFU conventionally
leaves it out). Compiled code reached in that step runs eagerly while it is counted
(`compiled_eagerly`) and compiles on the step after: dynamo marks a frame it first meets
under a dispatch mode (the counter is one) as never to be compiled, so a step counted as
it compiled would leave the whole run eager (docs/facts.md). The count is per rank: each
rank runs its own micro-batches. Achieved TFLOP/s is that count over the measured step
time; MFU divides it by the device's dense peak for the kind its matmuls run as
(`peaks.py`), only where the peak is known: on a CPU or an unlisted GPU there is no MFU
rather than a guessed one, unless the caller passes the peak itself (`override_tflops`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar

import psutil
import torch
from torch.utils.flop_counter import FlopCounterMode

from ddp_amp.metrics.peaks import dense_peak_tflops
from ddp_amp.torch_api import COMPILER_STANCE, compiled_eagerly

T = TypeVar("T")


def can_count_flops(compiling: bool) -> bool:
    """Whether `counting_flops` can count a step of a run that compiles (`compiling`) on this torch."""
    return not compiling or COMPILER_STANCE.available()


def counting_flops(run: Callable[[], T]) -> tuple[T, int]:
    """`run()`'s result and the model FLOPs it performed on this process; compiled code it
    reaches runs eagerly, and compiles on its next call (torch 2.6 on: `can_count_flops`)."""
    counter = FlopCounterMode(display=False)
    with compiled_eagerly() if COMPILER_STANCE.available() else nullcontext(), counter, warnings.catch_warnings():
        # torch.compile's module warns of the counter's global module hooks, which fire
        # only during this eager step.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        result = run()
    return result, int(counter.get_total_flops())


def memory_mb(device: torch.device) -> float:
    """Memory in use now: CUDA tensors on a GPU, else this process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


def utilization(flops_per_step: int, step_time: float, device: torch.device, matmul_kind: str,
                override_tflops: float | None = None) -> tuple[float, float | None]:
    """(achieved TFLOP/s, MFU) of steps of `flops_per_step` taking `step_time` s, whose matmuls
    run as `matmul_kind` (`Precision.matmul_kind()`); MFU is None where the device's dense
    peak for it is unknown and no `override_tflops` is given."""
    achieved = flops_per_step / step_time / 1e12
    peak = dense_peak_tflops(device, matmul_kind, override_tflops)
    return achieved, (achieved / peak if peak else None)


def throughput_fields(flops_per_step: int | None, step_time: float, samples_per_s: float,
                      tokens_per_sample: int, device: torch.device, matmul_kind: str,
                      override_tflops: float | None = None) -> dict[str, Any]:
    """The log's throughput and memory fields for a window of steps (absent where unknown)."""
    fields: dict[str, Any] = {}
    if tokens_per_sample:
        fields["tokens_per_s"] = samples_per_s * tokens_per_sample
    if flops_per_step and step_time > 0:
        fields["tflops"], mfu = utilization(flops_per_step, step_time, device, matmul_kind, override_tflops)
        if mfu is not None:
            fields["mfu"] = mfu
    fields["mem_mb"] = memory_mb(device)
    return fields
