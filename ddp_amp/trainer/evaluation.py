"""The task's metric on its held-out data, exact over any number of ranks (collective).

Every item is scored exactly once over the data-parallel ranks (a strided shard, no
padding), and each metric's sum and count are added up over batches and ranks before the
division, so the result does not depend on the world size. A task with held-out data but no `metric` or
`eval_fn` is scored by its loss (its `loss_fn`, or the model's own `.loss`), weighted by
each batch's items: `eval_loss`, the mean over all items.

Which names an evaluation reports is known before training (`reported_metrics`: one
held-out item through the metric), so an option that names one is checked before anything
is written.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_amp.data import collate
from ddp_amp.errors import UsageError
from ddp_amp.session import Session
from ddp_amp.tasks import Task
from ddp_amp.trainer.batch_loss import BatchLoss, whole


@torch.no_grad()
def evaluate(task: Task, forward: nn.Module, train_mode_of: nn.Module, session: Session,
             micro_batch_size: int, data: Dataset | None = None, prefix: str = "eval_",
             collective_forward: bool = False) -> dict[str, float]:
    """`task.metric` (or `task.eval_fn`) over `data` (default `task.eval_data`), names prefixed
    (collective: all ranks call it).

    `forward` runs the batches: the autocast wrapper, not DDP (no gradient buckets, no
    buffer broadcast, the same dtype the training forward used). `train_mode_of` is put
    in eval mode for the pass and back in train mode after it. `collective_forward`: every
    forward talks to the other ranks (a sharded model gathers its weights), so every rank
    runs as many batches as the rank with the most, the extra ones at weight 0.
    """
    data = task.eval_data if data is None else data
    if data is None:
        return {}
    score, ctx = _scorer(task), session.ctx
    # Strided over the data-parallel ranks: ranks that differ only in a model-parallel
    # dimension score the same items, and the all-reduced sums and counts scale alike (ranks
    # that split sequences score each its part of them: their sums and counts add up).
    sampler = range(ctx.dp_rank, len(data), ctx.dp_size)  # type: ignore[arg-type]  # torch's Dataset declares no __len__; a map-style one has it
    # A held-out set smaller than the world leaves some ranks no item; they still have
    # to join one all-reduce per metric name, so they score item 0 and add it at weight 0.
    weight = 1.0 if len(sampler) else 0.0
    if not sampler:
        sampler = range(1)
    sums: dict[str, torch.Tensor] = {}

    def add(batch: Any, batch_weight: float) -> None:
        with session.loss_parallel():  # a split model's logits are scored on their parts
            scored = score(forward, session.split_sequences(session.to_device(batch)))
        for name, (total, count) in scored.items():
            pair = batch_weight * torch.stack([whole(total).detach().double().to(ctx.device),
                                               torch.tensor(float(count), dtype=torch.float64, device=ctx.device)])
            sums[name] = sums[name] + pair if name in sums else pair

    train_mode_of.eval()
    try:
        # A generator of its own: a DataLoader draws its base seed from the global RNG
        # otherwise, and evaluating would change the dropout of the steps after it.
        loader = DataLoader(data, batch_size=micro_batch_size, sampler=sampler,
                            generator=torch.Generator(), collate_fn=collate)
        first, done = None, 0
        for batch in loader:
            first = batch if first is None else first
            add(batch, weight)
            done += 1
        if collective_forward:  # as many as the rank with the most: its share rounded up, in batches
            most = math.ceil(math.ceil(len(data) / ctx.dp_size) / micro_batch_size)  # type: ignore[arg-type]  # Dataset's stubs lack __len__
            for _ in range(most - done):
                add(first, 0.0)
    finally:
        train_mode_of.train()
    means = {}
    for name in sorted(sums):  # same order on all ranks: the all-reduces pair up
        total, count = session.all_reduce(sums[name]).tolist()
        means[name] = total / max(count, 1.0)
    if task.finalize_metrics is not None:
        means = task.finalize_metrics(means)
    return {f"{prefix}{name}": value for name, value in means.items()}


Scorer = Any  # (model, batch) -> {name: (sum tensor, count)}


def _scorer(task: Task) -> Scorer:
    """How one held-out batch is scored: the task's eval_fn or metric, else its loss."""
    if task.eval_fn is not None:  # the task scores batches of its own shape
        return task.eval_fn
    if task.metric is not None:
        metric = task.metric
        return lambda model, batch: metric(model(batch[0]), batch[1])
    batch_loss = BatchLoss(task)

    def loss_of(model: nn.Module, batch: Any) -> dict[str, tuple[torch.Tensor, int]]:
        loss, _ = batch_loss(model, batch)
        items = _items(batch)
        return {"loss": (loss.detach().float() * items, items)}
    return loss_of


def _items(batch: Any) -> int:
    """How many items a collated batch holds: the first tensor's length."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else \
        vars(batch).values()
    return next((_items(value) for value in values if isinstance(value, (torch.Tensor, dict, list, tuple))), 1)


@torch.no_grad()
def reported_metrics(task: Task, session: Session, model: nn.Module | None = None) -> list[str]:
    """The names an evaluation of `task` reports (`eval_...`), found by scoring one held-out
    item with `model` (the task's by default; no collective unless it is sharded); the RNGs
    and the model's mode are left as they were."""
    model = model if model is not None else task.model
    if task.eval_data is None or model is None:
        return []
    device = session.device
    model = model.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            scored = _scorer(task)(model, session.split_sequences(session.to_device(collate([task.eval_data[0]]))))
    finally:
        model.train(was_training)
    names = {name: 1.0 for name in scored}
    if task.finalize_metrics is not None:
        names = task.finalize_metrics(names)
    return sorted(f"eval_{name}" for name in names)


def check_metric_names(names: list[str], wanted: dict[str, tuple[str, str, str]]) -> None:
    """Raise the one-line UsageError `metric_of` would, for each option whose metric is not
    among `names`; `wanted`: metric -> (option, its value, hint with `{name}`)."""
    for metric, (what, value, example) in wanted.items():
        metric_of({name: 0.0 for name in names}, metric, what, value, example)


def metric_of(record: dict[str, Any], metric: str, what: str, value: str, example: str) -> float:
    """`record[metric]` of an evaluation's record, or a one-line error naming the metrics it
    has; `example` is the hint, with `{name}` for one of them (`--keep-best {name}`)."""
    if metric not in record:
        names = sorted(name for name in record if name != "step")
        raise UsageError(what, value, f"a metric the task's evaluation reports ({', '.join(names)})",
                         "e.g. " + example.format(name=names[0] if names else "eval_loss"))
    return float(record[metric])
