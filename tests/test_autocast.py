"""The autocast wrapper: autocast inside forward reaches other threads; picklable; unwrap."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from torch import nn

from ddp_amp.amp import AutocastModule, Precision, unwrap_model

BF16, FP16, FP32 = Precision("bf16", "cpu"), Precision("fp16", "cpu"), Precision("fp32", "cpu")


def _forward_in_thread(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    result: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: result.append(model(inputs)))
    thread.start()
    thread.join()
    return result[0]


def test_forward_in_another_thread_uses_the_configured_dtype() -> None:
    inner = nn.Linear(8, 8)
    inputs = torch.randn(4, 8)
    # Autocast is thread-local: the main thread's context does not reach the worker thread.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _forward_in_thread(inner, inputs).dtype == torch.float32
    wrapped = AutocastModule(inner, BF16)
    assert _forward_in_thread(wrapped, inputs).dtype == torch.bfloat16


def test_cast_outputs_to_fp32_and_disabled_wrapper() -> None:
    inputs = torch.randn(2, 4)
    casting = AutocastModule(nn.Linear(4, 4), FP16, cast_outputs_to_fp32=True)
    assert casting(inputs).dtype == torch.float32
    off = AutocastModule(nn.Linear(4, 4), FP32)
    assert off(inputs).dtype == torch.float32


class AttributeOutput(dict):
    """Like a Hugging Face ModelOutput: a dict whose values are also attributes."""

    def __getattr__(self, name: str) -> torch.Tensor:
        return self[name]


class LogitsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, inputs: torch.Tensor) -> AttributeOutput:
        return AttributeOutput(logits=self.linear(inputs), note="kept")


def test_a_dict_output_of_its_own_class_keeps_its_class_when_cast() -> None:
    output = AutocastModule(LogitsModel(), BF16, cast_outputs_to_fp32=True)(torch.randn(2, 4))
    assert type(output) is AttributeOutput and output.logits.dtype == torch.float32 and output.note == "kept"


def test_wrapper_pickles_and_unwraps_to_the_users_module() -> None:
    inner = nn.Linear(3, 3)
    wrapped = AutocastModule(inner, BF16)
    assert wrapped.unwrap() is inner and unwrap_model(wrapped) is inner
    clone = pickle.loads(pickle.dumps(wrapped))
    assert clone.precision == BF16 and torch.equal(clone.unwrap().weight, inner.weight)
    assert clone(torch.randn(1, 3)).dtype == torch.bfloat16


def test_an_outer_region_of_another_precision_gives_way_to_the_wrappers() -> None:
    """The wrapper's precision wins inside its forward: an fp32 wrapper under a caller's bf16
    region runs fp32, a bf16 wrapper under the same region adds nothing and runs bf16."""
    inputs = torch.randn(2, 4)
    with BF16.autocast():
        assert AutocastModule(nn.Linear(4, 4), FP32)(inputs).dtype == torch.float32
        assert AutocastModule(nn.Linear(4, 4), BF16)(inputs).dtype == torch.bfloat16
        assert BF16.autocast() is BF16.autocast()  # already in effect: the shared no-op, nothing entered
        assert isinstance(FP32.autocast(), torch.autocast)  # another state: entered for real
    assert not isinstance(FP32.autocast(), torch.autocast)  # fp32 outside any region: nothing to enter


def test_torch_autocast_is_entered_by_one_module_of_the_package() -> None:
    """Precision.autocast is the one entry: no other module of ddp_amp calls torch.autocast
    (the benchmark's hand-written reference loops aside, which are what ddp_amp is measured against)."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "ddp_amp"
    entering = re.compile(r"\btorch\.(amp\.)?autocast\(|\bfrom torch(\.amp)? import autocast\b")
    callers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if entering.search(path.read_text()))
    assert callers == ["amp/precision.py", "bench/recipe.py"]


def test_a_precision_given_as_device_and_dtype_is_refused_with_how() -> None:
    from ddp_amp.errors import UsageError

    with pytest.raises(UsageError, match=r"expected a ddp_amp Precision .*resolve_precision\('fp16'"):
        AutocastModule(nn.Linear(4, 4), "cpu", torch.float16)  # type: ignore[arg-type]
