"""Evaluation and inference under autocast, with no loss scaler; a checkpoint round trip.

    python examples/inference.py
    torchrun --standalone --nproc_per_node=2 examples/inference.py --checkpoint /tmp/model.pt

Train briefly, `session.save` a checkpoint (rank 0 writes), load it into a fresh model,
then evaluate. Evaluation needs autocast only: no scaler, no backward. It runs through
`session.local_module(model)`, the autocast wrapper inside DDP, so it makes no DDP
collectives (DDP would broadcast the BatchNorm buffers at every forward): each rank can
evaluate a different number of batches, and only the final sums are combined.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from ddp_amp import Session
from example_cli import run_example

STEPS, BATCH = 3, 16


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))


def batch(rank: int, index: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + index + (500 if split == "eval" else 0))
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x[:, :2].sum(dim=1, keepdim=True)


def evaluate(session: Session, model: nn.Module) -> dict[str, object]:
    """Mean squared error over this rank's share (rank r has r + 2 batches), then over ranks."""
    local = session.local_module(model)
    local.eval()
    total, count, dtypes = 0.0, 0, set()
    with torch.inference_mode():
        for index in range(session.rank + 2):
            x, y = session.to_device(batch(session.rank, index, "eval"))
            out = local(x)
            dtypes.add(str(out.dtype))
            with session.autocast():
                total += nn.functional.mse_loss(out, y, reduction="sum").item()
            count += y.numel()
    local.train()
    shares = session.all_gather_objects((total, count))
    return {"mse": sum(s[0] for s in shares) / sum(s[1] for s in shares),
            "batches": session.rank + 2, "output_dtypes": sorted(dtypes)}


def fp32_mse(model: nn.Module, world_size: int) -> float:
    """The same evaluation in fp32 on the plain module, every rank's share, for comparison."""
    model = copy.deepcopy(model).float().cpu().eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for rank in range(world_size):
            for index in range(rank + 2):
                x, y = batch(rank, index, "eval")
                total += nn.functional.mse_loss(model(x), y, reduction="sum").item()
                count += y.numel()
    return total / count


def flat_state(model: nn.Module) -> list[float]:
    """Every parameter and buffer of the user's module, as one list."""
    state = Session.unwrap(model).state_dict().values()
    return torch.cat([t.detach().double().flatten().cpu() for t in state]).tolist()


def train(session: Session, checkpoint: str) -> dict[str, object]:
    torch.manual_seed(0)
    model = session.setup(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = session.to_device(batch(session.rank, step, "train"))
        with session.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    # Rank 0's replica is the one saved. (BatchNorm running stats differ per rank after the
    # last forward: DDP broadcasts buffers *before* each forward, so rank 0's are the truth.)
    session.save(checkpoint, {"model": model, "optimizer": optimizer, "step": STEPS})
    facts: dict[str, object] = {"trained_state": flat_state(model)}
    scale_before = session.scaler.get_scale()

    torch.manual_seed(1)  # a different initialisation, overwritten by the checkpoint
    restored = session.setup(make_model())
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=0.01)
    saved = session.load(checkpoint, {"model": restored, "optimizer": restored_optimizer})
    facts["restored_state"] = flat_state(restored)
    facts["eval"] = evaluate(session, restored)
    facts["restored_step"] = saved["step"]
    facts["fp32_mse"] = fp32_mse(session.unwrap(restored), session.world_size)
    facts["scale_unchanged_by_eval"] = session.scaler.get_scale() == scale_before
    facts["optimizer_state_equal"] = all(
        torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in
        zip(optimizer.state_dict()["state"].values(), restored_optimizer.state_dict()["state"].values()))
    return facts


def main() -> None:
    def add_checkpoint(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--checkpoint", default="runs/inference-example.pt",
                            help="where to save; every rank reads it back, so on several nodes a shared path")

    run_example(__doc__.splitlines()[0], train,
                lambda rank: f"eval: {rank['eval']} fp32: {rank['fp32_mse']}",
                add_arguments=add_checkpoint, train_args=lambda args: (args.checkpoint,))


if __name__ == "__main__":
    main()
