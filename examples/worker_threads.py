"""Forwards that run in worker threads: why autocast lives inside the model.

    python examples/worker_threads.py
    torchrun --standalone --nproc_per_node=2 examples/worker_threads.py

Autocast state is thread-local. A `with torch.autocast(...)` in the main thread does not
reach a forward that a worker thread runs (a serving thread pool, a pipelined loader, a
DataParallel replica): that forward silently runs in fp32. A model from
`session.setup` enters autocast inside its own forward, so it runs in the session's
precision in whatever thread calls it. Code outside the model (a loss) that runs in a
worker enters `session.autocast()` in that worker.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

STEPS, BATCH, CHUNKS = 3, 16, 4


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x[:, :1] * 2.0


def train(session: Session) -> dict[str, object]:
    torch.manual_seed(0)
    model = session.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    facts: dict[str, object] = {"train_output_dtypes": [], "skipped": []}

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> str:
        """One training forward and backward, run by a worker thread (DDP allows one at a time)."""
        out = model(x)
        with session.autocast():  # entered in this thread: the loss is computed here
            loss = nn.functional.mse_loss(out, y)
        session.backward(loss)
        return str(out.dtype)

    with ThreadPoolExecutor(max_workers=CHUNKS) as pool:
        for step in range(STEPS):
            x, y = session.to_device(batch(session.rank, step))
            facts["train_output_dtypes"].append(pool.submit(forward_backward, x, y).result())
            facts["skipped"].append(int(session.step(optimizer).skipped))
            optimizer.zero_grad(set_to_none=True)

        # Inference fanned out over threads, through the autocast wrapper (no DDP).
        # inference_mode is thread-local too, so each worker enters it itself.
        local, plain = session.local_module(model), session.unwrap(model)

        def infer(module: nn.Module, chunk: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return module(chunk)

        x, _ = session.to_device(batch(session.rank, STEPS))
        whole = infer(local, x)
        parts = list(pool.map(infer, [local] * CHUNKS, x.chunk(CHUNKS)))
        # The trap: autocast entered here, in the main thread, does not reach the workers.
        with session.autocast():
            naive = list(pool.map(infer, [plain] * CHUNKS, x.chunk(CHUNKS)))
    facts["threaded_output_dtypes"] = sorted({str(p.dtype) for p in parts})
    facts["naive_output_dtypes"] = sorted({str(p.dtype) for p in naive})
    facts["threaded_matches_whole"] = torch.allclose(torch.cat(parts).float(), whole.float(), atol=1e-3)
    facts["params"] = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist()
    return facts


def main() -> None:
    run_example(__doc__.splitlines()[0], train, lambda rank: {k: v for k, v in rank.items() if k != "params"},
                scaler_options={"init_scale": 1024.0})


if __name__ == "__main__":
    main()
