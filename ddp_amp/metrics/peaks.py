"""Dense peak TFLOP/s of known GPUs, per precision: the denominator of MFU.

Figures are the vendors' data-sheet numbers without sparsity. An unknown GPU, or a CPU,
has no peak here and gets no MFU: a guessed denominator would make the figure meaningless.
fp32 is the plain fp32 rate unless torch is set to run fp32 matmuls as TF32
(`torch.backends.cuda.matmul.allow_tf32`, or `set_float32_matmul_precision` "high").
"""

from __future__ import annotations

import torch

# name substring -> {precision: dense TFLOP/s}; the first match wins, so "H100 PCIe" is
# listed before "H100" (the SXM part, whose name has no suffix).
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"fp8": 1979.0, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"fp8": 1979.0, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L4", {"fp8": 242.0, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
)


def _matmul_kind(precision: str) -> str:
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return precision


def dense_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The GPU's dense peak for `precision` (fp32, tf32, bf16, fp16, fp8), or None if unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in _PEAKS:
        if key in name:
            return peaks.get(_matmul_kind(precision))
    return None
