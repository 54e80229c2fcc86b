"""The autocast wrapper: autocast inside forward reaches other threads; picklable; unwrap."""

from __future__ import annotations

import pickle
import threading

import torch
from torch import nn

from ddp_amp.amp import AutocastModule, unwrap_model


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
    wrapped = AutocastModule(inner, "cpu", torch.bfloat16)
    assert _forward_in_thread(wrapped, inputs).dtype == torch.bfloat16


def test_cast_outputs_to_fp32_and_disabled_wrapper() -> None:
    inputs = torch.randn(2, 4)
    casting = AutocastModule(nn.Linear(4, 4), "cpu", torch.float16, cast_outputs_to_fp32=True)
    assert casting(inputs).dtype == torch.float32
    off = AutocastModule(nn.Linear(4, 4), "cpu", torch.float16, enabled=False)
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
    output = AutocastModule(LogitsModel(), "cpu", torch.bfloat16, cast_outputs_to_fp32=True)(torch.randn(2, 4))
    assert type(output) is AttributeOutput and output.logits.dtype == torch.float32 and output.note == "kept"


def test_wrapper_pickles_and_unwraps_to_the_users_module() -> None:
    inner = nn.Linear(3, 3)
    wrapped = AutocastModule(inner, "cpu", torch.bfloat16)
    assert wrapped.unwrap() is inner and unwrap_model(wrapped) is inner
    clone = pickle.loads(pickle.dumps(wrapped))
    assert clone.dtype == torch.bfloat16 and torch.equal(clone.unwrap().weight, inner.weight)
    assert clone(torch.randn(1, 3)).dtype == torch.bfloat16
