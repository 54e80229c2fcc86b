"""--precision resolution per device and the scaler each precision gets."""

from __future__ import annotations

import pytest
import torch

from ddp_amp.errors import UsageError
from ddp_amp.amp import cpu_has_native_bf16, resolve_precision

CPU = torch.device("cpu")


def test_auto_on_cpu_follows_native_bf16_units_and_says_why() -> None:
    chosen = resolve_precision("auto", CPU)
    assert chosen.name == ("bf16" if cpu_has_native_bf16() else "fp32")
    assert chosen.reason.startswith("auto:") and ("bf16" in chosen.reason)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_explicit_choice_is_honoured_on_cpu(name: str) -> None:
    chosen = resolve_precision(name, CPU)
    assert chosen.name == name
    with chosen.autocast():
        out = torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert out.dtype == chosen.dtype


def test_only_fp16_gets_an_enabled_scaler() -> None:
    assert resolve_precision("fp16", CPU).make_scaler().is_enabled()
    assert not resolve_precision("bf16", CPU).make_scaler().is_enabled()
    assert not resolve_precision("fp32", CPU).make_scaler().is_enabled()


def test_unknown_precision_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"fp4.*one of auto, fp32, bf16, fp16, fp8"):
        resolve_precision("fp4", CPU)
