"""`Session(precision=..., device=...)` takes torch's spellings (`"float16"`, `torch.bfloat16`,
`"cuda:0"`, a `torch.device`), and refuses a bad one in one line that names the keyword, not
the command line's flag (which the CLI's own refusals keep naming)."""

from __future__ import annotations

import pytest
import torch

from ddp_amp import Session, UsageError
from ddp_amp.trainer.options import CommandLineSession


@pytest.mark.parametrize("spelled, name", [("float16", "fp16"), ("torch.float16", "fp16"), ("half", "fp16"),
                                           (torch.float16, "fp16"), ("bfloat16", "bf16"), (torch.bfloat16, "bf16"),
                                           ("float32", "fp32"), ("torch.float32", "fp32"), ("fp16", "fp16")])
def test_torchs_dtype_names_are_precisions(spelled: str | torch.dtype, name: str) -> None:
    with Session(spelled, torch.device("cpu"), environ={}) as session:
        assert session.precision.name == name and session.device == torch.device("cpu")


def _refusal(session: Session) -> str:
    with pytest.raises(UsageError) as refused:
        session.start()
    message = str(refused.value)
    assert "\n" not in message and "hint:" in message, message
    return message


@pytest.mark.parametrize("keywords, start", [
    ({"precision": "float8"}, "precision='float8': expected one of auto, fp32, bf16, fp16, fp8 (or torch's"),
    ({"precision": torch.int8}, "precision=torch.int8: expected one of"),
    ({"device": "mps"}, "device='mps': expected one of auto, cuda, cpu, or one GPU as cuda:N"),
    ({"device": "cuda:x"}, "device='cuda:x': expected one of auto, cuda, cpu"),
])
def test_a_bad_spelling_is_one_line_naming_the_keyword(keywords: dict[str, object], start: str) -> None:
    message = _refusal(Session(**keywords, environ={}))  # type: ignore[arg-type]  # bad values on purpose
    assert message.startswith(start) and "--" not in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU, so cuda:0 is valid here")
def test_a_gpu_on_a_machine_without_one_names_the_keyword_and_the_cli_names_its_flag() -> None:
    message = _refusal(Session("float16", "cuda:0", environ={}))
    assert message.startswith("device='cuda:0': expected a machine with a CUDA GPU") and 'device="cpu"' in message
    assert "--device" not in message, message
    message = _refusal(CommandLineSession("fp16", "cuda", environ={}))
    assert message.startswith("--device='cuda'") and "--device cpu" in message, message
