"""Dense peaks by exact GPU model (no GPU needed): the names torch reports, the ones easily
confused, unknown devices, the user's override, and the MFU `utilization` computes from them."""

from __future__ import annotations

import logging

import pytest
import torch

from ddp_amp.errors import UsageError
from ddp_amp.amp import Precision
from ddp_amp.metrics import dense_peak_tflops, dense_peak_tflops_for, utilization
from ddp_amp.metrics.peaks import GPUS, gpu_model, peak_or_notice

GB = 10**9

# (name torch reports, capability, SMs, memory in bytes) -> the model docs/peaks.md lists
REPORTED = [
    (("NVIDIA H100 80GB HBM3", (9, 0), 132, 85 * GB), "H100 SXM"),
    (("NVIDIA H100 PCIe", (9, 0), 114, 85 * GB), "H100 PCIe"),
    (("NVIDIA H100 NVL", (9, 0), 132, 100 * GB), "H100 NVL"),
    (("NVIDIA H200", (9, 0), 132, 150 * GB), "H200 SXM"),
    (("NVIDIA H200 NVL", (9, 0), 132, 150 * GB), "H200 NVL"),
    (("NVIDIA A100-SXM4-40GB", (8, 0), 108, 42 * GB), "A100 SXM"),
    (("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85 * GB), "A100 SXM"),
    (("NVIDIA A100-PCIE-40GB", (8, 0), 108, 42 * GB), "A100 PCIe"),
    (("NVIDIA A100 80GB PCIe", (8, 0), 108, 85 * GB), "A100 PCIe"),
    (("NVIDIA L40S", (8, 9), 142, 48 * GB), "L40S"),
    (("NVIDIA L40", (8, 9), 142, 48 * GB), "L40"),
    (("NVIDIA L4", (8, 9), 58, 24 * GB), "L4"),
    (("NVIDIA A10", (8, 6), 72, 24 * GB), "A10"),
    (("NVIDIA GeForce RTX 4090", (8, 9), 128, 25 * GB), "RTX 4090"),
    (("NVIDIA GeForce RTX 3090", (8, 6), 82, 25 * GB), "RTX 3090"),
    (("Tesla V100-SXM2-16GB", (7, 0), 80, 17 * GB), "V100 SXM2"),
    (("AMD Instinct MI300X", (9, 4), 304, 206 * GB), "MI300X"),
    (("NVIDIA B200", (10, 0), 148, 190 * GB), "B200"),
]


@pytest.mark.parametrize(("reported", "model"), REPORTED, ids=[r[0][0] for r in REPORTED])
def test_each_reported_name_is_its_own_model(reported: tuple[str, tuple[int, int], int, int], model: str) -> None:
    gpu = gpu_model(*reported)
    assert gpu is not None and gpu.model == model
    assert dense_peak_tflops_for(*reported, "bf16" if "V100" not in model else "fp16") == \
        gpu.tflops["bf16" if "V100" not in model else "fp16"]


def _bf16(name: str, capability: tuple[int, int], sm_count: int | None = None,
          memory_bytes: int | None = None) -> float | None:
    return dense_peak_tflops_for(name, capability, sm_count, memory_bytes, "bf16")


def test_names_that_share_a_prefix_are_different_gpus() -> None:
    l40s, l40, l4 = _bf16("NVIDIA L40S", (8, 9)), _bf16("NVIDIA L40", (8, 9)), _bf16("NVIDIA L4", (8, 9))
    assert l40s == 362.05 and l40 == 181.05 and l4 == 121.0  # the data sheets' dense figures
    sxm, pcie, nvl = (_bf16(n, (9, 0)) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"))
    assert sxm == 989.4 and pcie == 756.0 and nvl == 835.5
    # the A10G is AWS's part with no vendor figure: it is not an A10
    assert _bf16("NVIDIA A10", (8, 6)) == 125.0 and _bf16("NVIDIA A10G", (8, 6)) is None


def test_a_bare_h100_is_told_apart_by_sm_count_then_memory() -> None:
    assert _bf16("NVIDIA H100", (9, 0), 114, 85 * GB) == 756.0  # PCIe: 114 SMs
    assert _bf16("NVIDIA H100", (9, 0), 132, 85 * GB) == 989.4  # SXM: 132 SMs, 80 GB
    assert _bf16("NVIDIA H100", (9, 0), 132, 100 * GB) == 835.5  # NVL: 132 SMs, 94 GB
    assert _bf16("NVIDIA H100", (9, 0)) is None  # nothing to tell them apart by: unknown


@pytest.mark.parametrize(("name", "capability"), [
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", (9, 0)),  # a MIG slice has a fraction of the SMs
    ("NVIDIA GeForce RTX 4090 D", (8, 9)),
    ("NVIDIA L4", (8, 6)),  # the right name on the wrong architecture is not that GPU
    ("AMD Radeon Graphics", (9, 4)),
    ("NVIDIA Graphics Device", (9, 0)),
])
def test_names_outside_the_table_are_unknown(name: str, capability: tuple[int, int]) -> None:
    assert gpu_model(name, capability, 132, 85 * GB) is None
    assert all(dense_peak_tflops_for(name, capability, 132, 85 * GB, kind) is None
               for kind in ("fp8", "bf16", "fp16", "tf32", "fp32"))


def test_a_kind_the_chip_lacks_has_no_peak_and_a_bad_kind_is_refused() -> None:
    a100 = ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85 * GB)
    assert dense_peak_tflops_for(*a100, "fp8") is None
    assert dense_peak_tflops_for(*a100, "tf32") == 156.0 and dense_peak_tflops_for(*a100, "fp32") == 19.5
    v100 = ("Tesla V100-PCIE-32GB", (7, 0), 80, 34 * GB)
    assert dense_peak_tflops_for(*v100, "bf16") is None and dense_peak_tflops_for(*v100, "tf32") is None
    with pytest.raises(UsageError, match="matmul_kind='int8'"):
        dense_peak_tflops_for(*a100, "int8")


def test_every_entry_is_dense_and_ordered_like_the_hardware() -> None:
    for gpu in GPUS:
        rates = gpu.tflops
        assert set(rates) <= {"fp8", "bf16", "fp16", "tf32", "fp32"} and rates["fp32"] > 0, gpu.model
        # tensor-core rates double as the format halves (within the data sheets' rounding, 3%): a
        # sparse or mistyped figure among dense ones breaks the ratio
        if "fp8" in rates:
            assert rates["fp8"] == pytest.approx(2 * rates["bf16"], rel=0.03), gpu.model
        if "tf32" in rates and "bf16" in rates:
            assert rates["bf16"] == pytest.approx(2 * rates["tf32"], rel=0.03), gpu.model
    names = [(name, gpu.capability) for gpu in GPUS for name in gpu.names]
    shared = {key for key in names if names.count(key) > 1}
    # a name shared by models is resolvable only by their SM counts and memory ranges
    assert shared == {("h100", (9, 0))}


def test_tf32_is_the_kind_of_fp32_matmuls_only_where_torch_allows_it() -> None:
    assert Precision("bf16", "cuda").matmul_kind() == "bf16" and Precision("fp8", "cuda").matmul_kind() == "fp8"
    fp32 = Precision("fp32", "cuda")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert fp32.matmul_kind((9, 0)) == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert fp32.matmul_kind((9, 0)) == "tf32" and fp32.matmul_kind((8, 0)) == "tf32"
        assert fp32.matmul_kind((7, 0)) == "fp32"  # a V100 has no TF32 units
        assert Precision("fp32", "cpu").matmul_kind() == "fp32"  # nor a CPU
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_an_unknown_gpu_gets_one_notice_per_process(caplog: pytest.LogCaptureFixture) -> None:
    unknown = (f"NVIDIA Test Device {id(caplog)}", (9, 0), 100, 80 * GB)  # a name no other test uses
    with caplog.at_level(logging.WARNING, logger="ddp_amp.metrics.peaks"):
        assert [peak_or_notice(*unknown, kind) for kind in ("bf16", "bf16", "fp32")] == [None] * 3
        assert peak_or_notice("NVIDIA L4", (8, 9), 58, 24 * GB, "bf16") == 121.0
    assert len(caplog.records) == 1 and unknown[0] in caplog.records[0].getMessage()


def test_a_cpu_has_no_peak_unless_the_user_gives_one(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="ddp_amp.metrics.peaks"):
        assert dense_peak_tflops(cpu, "bf16") is None
    assert not caplog.records  # no notice: MFU on a CPU is not expected
    assert dense_peak_tflops(cpu, "bf16", override_tflops=12.5) == 12.5
    with pytest.raises(UsageError, match="override_tflops=0"):
        dense_peak_tflops(cpu, "bf16", override_tflops=0)


def test_utilization_divides_by_the_peak_exactly() -> None:
    h100 = dense_peak_tflops_for("NVIDIA H100 80GB HBM3", (9, 0), 132, 85 * GB, "bf16")
    assert h100 is not None
    flops, step_time = 3 * 10**14, 0.75  # 400 TFLOP/s achieved
    achieved, mfu = utilization(flops, step_time, torch.device("cpu"), "bf16", override_tflops=h100)
    assert achieved == flops / step_time / 1e12 and mfu == achieved / h100
    assert utilization(flops, step_time, torch.device("cpu"), "bf16") == (achieved, None)
