"""Dense peak TFLOP/s of known GPUs, per matmul kind: the denominator of MFU.

Figures are the vendors' data-sheet numbers without sparsity (docs/peaks.md gives each
figure's source). A GPU is looked up by its exact model, never by a part of its name:
"NVIDIA L40S" is not "NVIDIA L4", "NVIDIA H100 PCIe" is not the SXM part. The name is
normalised first (`normalise_name`: case, the vendor prefix, hyphens and spaces, memory
sizes such as "80GB"), then it must be one of a model's names and the device's compute
capability must be that model's. Where one name covers several models (a bare "H100"),
the SM count and then the memory size decide; if they cannot, the GPU is unknown.

An unknown GPU, or a CPU, has no peak: MFU is left out rather than computed against a
guess. `dense_peak_tflops` logs one notice per unknown GPU name and process; a user's
`override_tflops` (the peak they know for their device) is used for any device.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ddp_amp.errors import UsageError

log = logging.getLogger(__name__)

MATMUL_KINDS = ("fp8", "bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class GpuPeaks:
    """One GPU model: the names it reports, its compute capability and its dense peaks."""

    model: str  # the name docs/peaks.md uses
    names: tuple[str, ...]  # normalised device names (`normalise_name`)
    capability: tuple[int, int]
    tflops: Mapping[str, float]  # matmul kind -> dense TFLOP/s; a kind the chip lacks is absent
    sm_count: int | None = None  # consulted only where several models share a name
    memory_gb: tuple[float, float] | None = None  # [low, high) in 1e9 bytes, likewise


def _peaks(fp8: float | None, bf16: float | None, fp16: float, tf32: float | None, fp32: float) -> dict[str, float]:
    given = {"fp8": fp8, "bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32}
    return {kind: value for kind, value in given.items() if value is not None}


_H100_SXM = _peaks(1978.9, 989.4, 989.4, 494.7, 66.9)
_H100_NVL = _peaks(1670.5, 835.5, 835.5, 417.5, 60.0)
_A100 = _peaks(None, 312.0, 312.0, 156.0, 19.5)

GPUS: tuple[GpuPeaks, ...] = (
    GpuPeaks("H100 SXM", ("h100 hbm3", "h100 sxm5", "h100 sxm", "h100"), (9, 0), _H100_SXM,
             sm_count=132, memory_gb=(0, 90)),
    GpuPeaks("H100 PCIe", ("h100 pcie", "h100"), (9, 0), _peaks(1513.0, 756.0, 756.0, 378.0, 51.2), sm_count=114),
    GpuPeaks("H100 NVL", ("h100 nvl", "h100"), (9, 0), _H100_NVL, sm_count=132, memory_gb=(90, 1e6)),
    GpuPeaks("H200 SXM", ("h200", "h200 sxm"), (9, 0), _H100_SXM),
    GpuPeaks("H200 NVL", ("h200 nvl",), (9, 0), _H100_NVL),
    GpuPeaks("B200", ("b200",), (10, 0), _peaks(4500.0, 2250.0, 2250.0, 1100.0, 75.0)),
    GpuPeaks("A100 SXM", ("a100 sxm4", "a100 sxm"), (8, 0), _A100),
    GpuPeaks("A100 PCIe", ("a100 pcie",), (8, 0), _A100),
    GpuPeaks("L40S", ("l40s",), (8, 9), _peaks(733.0, 362.05, 362.05, 183.0, 91.6)),
    GpuPeaks("L40", ("l40",), (8, 9), _peaks(362.0, 181.05, 181.05, 90.5, 90.5)),
    GpuPeaks("L4", ("l4",), (8, 9), _peaks(242.5, 121.0, 121.0, 60.0, 30.3)),
    GpuPeaks("A10", ("a10",), (8, 6), _peaks(None, 125.0, 125.0, 62.5, 31.2)),
    # GeForce: the fp32-accumulate rates, which torch's bf16/fp16/fp8 matmuls use.
    GpuPeaks("RTX 4090", ("geforce rtx 4090",), (8, 9), _peaks(330.3, 165.2, 165.2, 82.6, 82.6)),
    GpuPeaks("RTX 3090", ("geforce rtx 3090",), (8, 6), _peaks(None, 71.0, 71.0, 35.6, 35.6)),
    GpuPeaks("V100 SXM2", ("v100 sxm2",), (7, 0), _peaks(None, None, 125.0, None, 15.7)),
    GpuPeaks("V100 PCIe", ("v100 pcie",), (7, 0), _peaks(None, None, 112.0, None, 14.0)),
    GpuPeaks("V100S PCIe", ("v100s pcie",), (7, 0), _peaks(None, None, 130.0, None, 16.4)),
    GpuPeaks("MI300X", ("instinct mi300x", "instinct mi300x vf"), (9, 4), _peaks(2614.9, 1307.4, 1307.4, 653.7, 163.4)),
)

_PREFIXES = ("nvidia ", "amd ", "tesla ")
_MEMORY_SIZE = re.compile(r"^\d+gb$")  # "80gb": the same chip with more or less memory
_noticed: set[str] = set()  # unknown device names already reported by this process


def normalise_name(name: str) -> str:
    """`name` as the table keys it: lower case, no vendor prefix, no memory size, single spaces.

    "NVIDIA A100-SXM4-40GB" -> "a100 sxm4"; "NVIDIA H100 80GB HBM3" -> "h100 hbm3".
    """
    text = " ".join(name.lower().replace("-", " ").replace("_", " ").split())
    stripped = True
    while stripped:
        stripped = False
        for prefix in _PREFIXES:
            if text.startswith(prefix):
                text, stripped = text[len(prefix):], True
    return " ".join(word for word in text.split() if not _MEMORY_SIZE.match(word))


def gpu_model(name: str, capability: tuple[int, int], sm_count: int | None = None,
              memory_bytes: int | None = None) -> GpuPeaks | None:
    """The table's entry for this device, or None if it is unknown or its name is ambiguous.

    A model matches when `normalise_name(name)` is one of its names and `capability` is its
    compute capability. Where several match (a bare "NVIDIA H100"), those whose SM count is
    `sm_count` remain, then those whose memory range holds `memory_bytes`; one must remain.
    """
    key = normalise_name(name)
    found = [gpu for gpu in GPUS if key in gpu.names and gpu.capability == tuple(capability)]
    if len(found) > 1 and sm_count is not None:
        found = [gpu for gpu in found if gpu.sm_count == sm_count]
    if len(found) > 1 and memory_bytes is not None:
        found = [gpu for gpu in found
                 if gpu.memory_gb is not None and gpu.memory_gb[0] <= memory_bytes / 1e9 < gpu.memory_gb[1]]
    return found[0] if len(found) == 1 else None


def dense_peak_tflops_for(name: str, capability: tuple[int, int], sm_count: int | None,
                          memory_bytes: int | None, matmul_kind: str) -> float | None:
    """Dense peak TFLOP/s of the GPU so described for `matmul_kind`, or None.

    `name`, `capability`, `sm_count` and `memory_bytes` are what torch reports
    (`get_device_properties`: name, (major, minor), multi_processor_count, total_memory).
    `matmul_kind` is one of fp8, bf16, fp16, tf32, fp32: the kind the matmuls run as, which
    the caller decides (`Precision.matmul_kind` turns fp32 into tf32 where torch runs it so). None for
    an unknown GPU or a kind the chip has no rate for (fp8 on an A100). Needs no GPU.
    """
    if matmul_kind not in MATMUL_KINDS:
        raise UsageError("matmul_kind", matmul_kind, "one of " + ", ".join(MATMUL_KINDS),
                         "the run's precision decides it; fp32 runs as tf32 where torch allows it")
    gpu = gpu_model(name, capability, sm_count, memory_bytes)
    return None if gpu is None else gpu.tflops.get(matmul_kind)


def dense_peak_tflops(device: torch.device, matmul_kind: str,
                      override_tflops: float | None = None) -> float | None:
    """The device's dense peak for `matmul_kind` (fp8, bf16, fp16, tf32, fp32), or None.

    `override_tflops`, where given, is the peak for any device, a CPU included (the user
    asked for MFU against it). Otherwise a CPU has none, and a GPU missing from the table
    has none: the first time a process meets such a GPU name it logs one notice naming the
    device and how to give its peak.
    """
    if override_tflops is not None:
        if not override_tflops > 0:
            raise UsageError("override_tflops", override_tflops, "a positive number of dense TFLOP/s",
                             "give your device's dense (no sparsity) peak for the run's precision")
        return float(override_tflops)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return peak_or_notice(props.name, (props.major, props.minor), props.multi_processor_count,
                          props.total_memory, matmul_kind)


def peak_or_notice(name: str, capability: tuple[int, int], sm_count: int | None, memory_bytes: int | None,
                   matmul_kind: str) -> float | None:
    """`dense_peak_tflops_for`, logging one notice per process for each device name it has no peak for."""
    peak = dense_peak_tflops_for(name, capability, sm_count, memory_bytes, matmul_kind)
    if peak is None and name not in _noticed:
        _noticed.add(name)
        log.warning("no dense %s peak is known for %r (compute capability %d.%d, %s SMs): MFU is not "
                    "reported (give it with --peak-tflops; docs/peaks.md lists the GPUs known)",
                    matmul_kind, name, capability[0], capability[1], sm_count)
    return peak
