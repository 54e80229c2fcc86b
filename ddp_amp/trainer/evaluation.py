"""The task's metric on its held-out data, exact over any number of ranks (collective).

Every item is scored exactly once over all ranks (a strided shard, no padding), and each
metric's sum and count are added up over batches and ranks before the division, so the
result does not depend on the world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_amp.distributed import DistContext, all_reduce_, to_device
from ddp_amp.errors import UsageError
from ddp_amp.tasks import Task
from ddp_amp.trainer.stream import collate


@torch.no_grad()
def evaluate(task: Task, forward: nn.Module, train_mode_of: nn.Module, ctx: DistContext,
             micro_batch_size: int, data: Dataset | None = None, prefix: str = "eval_") -> dict[str, float]:
    """`task.metric` (or `task.eval_fn`) over `data` (default `task.eval_data`), names prefixed
    (collective: all ranks call it).

    `forward` runs the batches: the autocast wrapper, not DDP (no gradient buckets, no
    buffer broadcast, the same dtype the training forward used). `train_mode_of` is put
    in eval mode for the pass and back in train mode after it.
    """
    data = task.eval_data if data is None else data
    if data is None or (task.metric is None and task.eval_fn is None):
        return {}
    sampler = range(ctx.rank, len(data), ctx.world_size)  # type: ignore[arg-type]
    # A held-out set smaller than the world leaves some ranks no item; they still have
    # to join one all-reduce per metric name, so they score item 0 and add it at weight 0.
    weight = 1.0 if len(sampler) else 0.0
    if not sampler:
        sampler = range(1)
    sums: dict[str, torch.Tensor] = {}
    train_mode_of.eval()
    try:
        # A generator of its own: a DataLoader draws its base seed from the global RNG
        # otherwise, and evaluating would change the dropout of the steps after it.
        loader = DataLoader(data, batch_size=micro_batch_size, sampler=sampler,
                            generator=torch.Generator(), collate_fn=collate)
        for batch in loader:
            batch = to_device(batch, ctx.device)
            if task.eval_fn is not None:  # the task scores batches of its own shape
                scored = task.eval_fn(forward, batch)
            else:
                inputs, target = batch
                scored = task.metric(forward(inputs), target)  # type: ignore[misc]
            for name, (total, count) in scored.items():
                pair = weight * torch.stack([total.detach().double().to(ctx.device),
                                             torch.tensor(float(count), dtype=torch.float64, device=ctx.device)])
                sums[name] = sums[name] + pair if name in sums else pair
    finally:
        train_mode_of.train()
    means = {}
    for name in sorted(sums):  # same order on all ranks: the all-reduces pair up
        total, count = all_reduce_(sums[name]).tolist()
        means[name] = total / max(count, 1.0)
    if task.finalize_metrics is not None:
        means = task.finalize_metrics(means)
    return {f"{prefix}{name}": value for name, value in means.items()}


def metric_of(record: dict[str, Any], metric: str, what: str, value: str, example: str) -> float:
    """`record[metric]` of an evaluation's record, or a one-line error naming the metrics it
    has; `example` is the hint, with `{name}` for one of them (`--keep-best {name}`)."""
    if metric not in record:
        names = sorted(name for name in record if name != "step")
        raise UsageError(what, value, f"a metric the task's evaluation reports ({', '.join(names)})",
                         "e.g. " + example.format(name=names[0] if names else "eval_loss"))
    return float(record[metric])
