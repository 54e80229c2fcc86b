"""`--precision fp8`: float8 linear layers through torchao, refused where the device has no
float8 matmuls, exercised on CPU through torchao's emulation (same casts, ordinary matmuls)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_amp.amp import Precision, resolve_precision
from ddp_amp.checkpoint.safe_types import safe_load
from ddp_amp.distributed import DistContext
from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError
from ddp_amp.parallel import ParallelPlan, parallelize
from ddp_amp.tasks.mlp import make_model
from tests.multiproc import run_ranks, run_train

pytest.importorskip("torchao.float8")
CPU = torch.device("cpu")
SMALL = ["--task", "mlp", "--task-opt", "hidden=32", "--task-opt", "samples=512", "--batch-size", "32"]


def wrap_model(model: nn.Module, precision: Precision, ctx: DistContext) -> nn.Module:
    """The model as `Session.setup` makes it: replicated, the float8 conversion inside."""
    return parallelize(model, ParallelPlan(), precision, ctx).model


def one_process(device: torch.device) -> DistContext:
    return DistContext(DistEnv(), device, None)


def count_float8_linears(model: nn.Module) -> int:
    """How many layers of `model` run float8 matmuls."""
    return sum(type(module).__name__ == "Float8Linear" for module in model.modules())


def test_fp8_without_float8_matmuls_is_refused_with_a_hint() -> None:
    with pytest.raises(UsageError) as raised:
        resolve_precision("fp8", CPU)
    message = str(raised.value)
    assert "--precision='fp8'" in message and "compute capability 8.9" in message and "\n" not in message


def test_emulated_fp8_is_bf16_autocast_without_loss_scaling() -> None:
    chosen = resolve_precision("fp8", CPU, emulate_fp8=True)
    assert chosen.name == "fp8" and chosen.dtype == torch.bfloat16 and chosen.float8_linears
    assert not chosen.make_scaler().is_enabled()


def test_only_aligned_linear_layers_are_converted_and_parameters_are_kept() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))  # 10 is not a multiple of 16
    before = [id(p) for p in model.parameters()]
    wrapped = wrap_model(model, resolve_precision("fp8", CPU, emulate_fp8=True), one_process(CPU))
    assert count_float8_linears(wrapped) == 1
    assert [id(p) for p in wrapped.parameters()] == before  # optimizers and hooks see the same tensors
    output = wrapped(torch.randn(8, 32))
    assert output.dtype == torch.bfloat16  # the unconverted layer runs under bf16 autocast


def _two_rank_fp8_steps(ctx: DistContext) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = make_model(32, 64, 16, 3)
    wrapped = wrap_model(model, resolve_precision("fp8", ctx.device, emulate_fp8=True), ctx)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(ctx.rank)  # each rank its own data
    for _ in range(3):
        inputs, target = torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(wrapped(inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_two_ranks_of_fp8_stay_identical_under_ddp() -> None:
    first, second = run_ranks(_two_rank_fp8_steps, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], _fresh_first_weight())  # it trained


def _fresh_first_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return make_model(32, 64, 16, 3)[0].weight.detach()


def test_fp8_run_checkpoints_load_into_the_plain_model_and_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_train([*SMALL, "--precision", "fp8", "--fp8-emulate", "--max-steps", "4", "--ckpt-every", "2",
                       "--run-dir", str(run_dir)])
    assert first.returncode == 0, first.stderr[-2000:]
    saved = safe_load(run_dir / "checkpoints" / "step-00000004" / "model.pt")
    plain = make_model(64, 32, 16, 3)
    plain.load_state_dict(saved)  # strict: the same names, shapes and dtypes as the unconverted model
    assert all(v.dtype == torch.float32 for v in saved.values())

    # The run goes on, with the same precision, from the last checkpoint.
    again = run_train([*SMALL, "--precision", "fp8", "--fp8-emulate", "--max-steps", "6", "--run-dir",
                       str(run_dir)])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout and "step-00000004" in again.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["precision"] == "fp8" and summary["steps"] == 6


def test_a_bf16_run_can_go_on_in_fp8(tmp_path: Path) -> None:
    first = run_train([*SMALL, "--precision", "bf16", "--max-steps", "3", "--run-dir", str(tmp_path)])
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_train([*SMALL, "--precision", "fp8", "--fp8-emulate", "--max-steps", "5", "--run-dir",
                       str(tmp_path)])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "bf16" in again.stdout and "fp8" in again.stdout  # the precision change is announced
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5


@pytest.mark.cuda
def test_real_float8_matmuls_train_on_a_gpu_that_has_them() -> None:
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < (8, 9):
        with pytest.raises(UsageError, match="compute capability"):
            resolve_precision("fp8", device)
        return
    torch.manual_seed(0)
    model = make_model(256, 512, 256, 3)
    wrapped = wrap_model(model, resolve_precision("fp8", device), one_process(device))
    assert count_float8_linears(wrapped) == 3
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, fused=True)
    inputs, target = torch.randn(64, 256, device=device), torch.randn(64, 256, device=device)
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(wrapped(inputs).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    plain = make_model(256, 512, 256, 3)
    plain.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
