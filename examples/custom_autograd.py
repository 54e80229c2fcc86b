"""Custom autograd functions under autocast: `torch.amp.custom_fwd` / `custom_bwd`.

    python examples/custom_autograd.py
    torchrun --standalone --nproc_per_node=2 examples/custom_autograd.py

`custom_fwd` records the autocast state of the forward and `custom_bwd` restores it for
the backward, which otherwise runs outside any autocast region. `custom_fwd(cast_inputs=
torch.float32)` turns autocast *off* inside the forward and casts floating inputs to fp32:
the way to run a numerically touchy op in full precision inside an fp16 model.
Both decorators need the device type, so the functions are built for the session's device.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

STEPS, BATCH = 3, 16
SEEN: dict[str, object] = {}  # what the custom functions observed, for the facts file


def make_functions(device_type: str) -> tuple[type[torch.autograd.Function], type[torch.autograd.Function]]:
    class LowPrecisionMatmul(torch.autograd.Function):
        """a @ b in the autocast dtype, backward under the same autocast state."""

        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            SEEN["matmul_forward_autocast"] = torch.is_autocast_enabled(device_type)
            return a @ b

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            SEEN["matmul_backward_autocast"] = torch.is_autocast_enabled(device_type)
            return grad @ b.t(), a.t() @ grad

    class Fp32Softplus(torch.autograd.Function):
        """log(1 + exp(x)) in fp32 whatever the surrounding autocast says."""

        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            SEEN["softplus_input_dtype"] = str(x.dtype)
            SEEN["softplus_forward_autocast"] = torch.is_autocast_enabled(device_type)
            return torch.logaddexp(x, torch.zeros_like(x))

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            SEEN["softplus_backward_autocast"] = torch.is_autocast_enabled(device_type)
            return grad * torch.sigmoid(x)

    return LowPrecisionMatmul, Fp32Softplus


class Net(nn.Module):
    def __init__(self, matmul: type[torch.autograd.Function], softplus: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.matmul, self.softplus = matmul, softplus
        self.w1 = nn.Parameter(torch.randn(8, 16) * 0.3)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.matmul.apply(x, self.w1)
        SEEN["matmul_output_dtype"] = str(hidden.dtype)
        activated = self.softplus.apply(hidden)
        SEEN["softplus_output_dtype"] = str(activated.dtype)
        return self.head(activated)


class PlainNet(nn.Module):
    """The same math with built-in ops, for an fp32 reference gradient."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.w1, self.head = net.w1, net.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.softplus(x @ self.w1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x.abs().sum(dim=1, keepdim=True)


def train(session: Session) -> dict[str, object]:
    torch.manual_seed(0)
    model = session.setup(Net(*make_functions(session.precision.device_type)))
    reference = PlainNet(copy.deepcopy(session.unwrap(model))).cpu()  # the check runs on the CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    facts: dict[str, object] = {"skipped": []}
    for step in range(STEPS):
        x, y = session.to_device(batch(session.rank, step))
        with session.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        if step == 0:
            session.scaler.unscale_(optimizer)
            got = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
            reference.zero_grad()
            for rank in range(session.world_size):  # DDP averages over ranks
                rx, ry = batch(rank, step)
                (nn.functional.mse_loss(reference(rx), ry) / session.world_size).backward()
            want = torch.cat([p.grad.flatten() for p in reference.parameters()])
            facts["grad_rel_err"] = ((got - want).norm() / want.norm()).item()
        facts["skipped"].append(int(session.step(optimizer).skipped))
        optimizer.zero_grad(set_to_none=True)
    facts.update(SEEN)
    facts["params"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return facts


def main() -> None:
    run_example(__doc__.splitlines()[0], train, lambda rank: {k: v for k, v in rank.items() if k != "params"},
                scaler_options={"init_scale": 1024.0})


if __name__ == "__main__":
    main()
