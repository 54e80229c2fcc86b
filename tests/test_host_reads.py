"""Steady-state training steps read nothing from the device: no `.item()`, no host copy, no `bool(tensor)`.

On a GPU each such read stalls the host until the device has caught up, so the host cannot
queue the next step's kernels while this one runs. Reads belong to log, check and
checkpoint steps only. Two ways to see them:
- on any machine, a `TorchFunctionMode` that counts the Python-level calls that read a
  tensor's value on the host (`HostReadCounter`), around steady-state steps of the Trainer
  and of `Session`, over every built-in task, optimizer, schedule, clipping, accumulation
  and precision;
- on a GPU, the same steps under `torch.cuda.set_sync_debug_mode("error")`, which turns
  any synchronising call into an error (the `cuda` marker).
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ddp_amp import Session
from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.distributed.spawn import run_ranks
from tests.multiproc import in_turn
from ddp_amp.trainer import build_trainer, session_for

# Tensor methods that hand a value to the host (each is a device sync on a GPU).
HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "cpu",
              "numpy", "nonzero", "__format__", "__repr__", "__array__"}
WARMUP, MEASURED = 3, 8  # lazy inits happen in the warm-up (optimizer state, DDP buckets, scale)


class HostReadCounter(TorchFunctionMode):
    """Counts calls of `HOST_READS` (by name) made while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name == "to" and _to_cpu(args, kwargs)):
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


def _to_cpu(args: Any, kwargs: Any) -> bool:
    """Is this `Tensor.to(...)` a copy from another device to the host?"""
    tensor = args[0] if args else None
    target = (kwargs or {}).get("device", args[1] if len(args) > 1 else None)
    return isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu" and str(target).startswith("cpu")


# (task, precision, extra config): every built-in task in every precision with its own
# optimizer and schedule, then the mlp task through each optimizer, clipping and
# accumulation under fp16, the case with a scaler, and a per-step LR schedule (cosine) in
# bf16 and in fp16, where the LR of each taken step comes from a plan on the device
# (trainer/lr_steps.py) instead of a read of each step's skip flag.
TRAINER_CASES = [
    *[(task, precision, {}) for task in ("mlp", "lm", "digits") for precision in ("fp32", "bf16", "fp16")],
    ("mlp", "fp16", {"optimizer": "sgd"}),
    ("mlp", "fp16", {"optimizer": "adamw", "clip_grad_norm": 1.0}),
    ("mlp", "fp16", {"grad_accum": 2, "clip_grad_norm": 0.5}),
    ("mlp", "bf16", {"grad_accum": 2, "clip_grad_norm": 1.0}),
    ("tests.plugins.cosine_task:make_task", "bf16", {"clip_grad_norm": 1.0}),
    ("tests.plugins.cosine_task:make_task", "fp16", {"clip_grad_norm": 1.0}),
    # a task's own step with a logged scalar, and a model that computes its own loss
    ("tests.plugins.own_step_task:make_task", "fp16", {"grad_accum": 2, "task_opt": ("kind=dict_step",)}),
    ("tests.plugins.own_step_task:make_task", "bf16", {"task_opt": ("kind=own_loss",)}),
]
TASK_OPTIONS = {"lm": ("tokens=4000", "bptt=16", "emsize=16", "nhid=16"), "mlp": ("hidden=16", "samples=512"),
                "tests.plugins.cosine_task:make_task": ("hidden=16", "samples=512")}


def _trainer_reads(ctx: DistContext, cases: list[tuple[str, str, dict[str, Any]]],
                   device: str) -> list[dict[str, Any]]:
    """Collective: for each case, warm-up steps, then the measured steps under the counter."""
    results = []
    for task, precision, extra in cases:
        config = TrainConfig(task=task, precision=precision, device=device, batch_size=8 * ctx.world_size,
                             max_steps=1000, log_every=1000, **{"task_opt": TASK_OPTIONS.get(task, ()), **extra})
        trainer = build_trainer(session_for(config).start(), config)
        # The finite guard reads a CPU loss at once (no device to wait for there) and keeps a
        # GPU loss for a later fold: count the branch a GPU runs, whose reads would be syncs.
        trainer.watch.finite.read_at_once = False
        for _ in range(WARMUP):
            trainer.train_step()
        reads = _count(lambda: [trainer.train_step() for _ in range(MEASURED)], device)
        results.append({"case": f"{task} {precision} {extra}", "reads": dict(reads),
                        "fused": bool(trainer.optimizer.defaults.get("fused"))})
    return results


def _count(steps: Any, device: str) -> Counter[str]:
    """Run `steps` under the counter, and on CUDA also under the sync debug mode."""
    counter = HostReadCounter()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with counter:
            steps()
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return counter.reads


def _session_reads(ctx: DistContext, device: str) -> list[dict[str, Any]]:
    """Collective: Session steps with clipping and accumulation, fp16 and bf16."""
    results = []
    for precision, accum, clip in (("fp16", 2, 1.0), ("fp16", 1, None), ("bf16", 2, 1.0), ("fp32", 1, 1.0)):
        # One process: an empty environment, so no group; two ranks: join the spawned group.
        with Session(precision, device, environ=None if ctx.has_group else {}) as session:
            torch.manual_seed(0)
            model = session.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            batches = [session.to_device((torch.randn(4, 8), torch.randn(4, 2))) for _ in range(accum)]

            def step() -> None:
                for index, (x, y) in enumerate(batches):
                    context = session.no_sync(model) if index < accum - 1 else nullcontext()
                    with context:
                        with session.autocast():
                            loss = nn.functional.mse_loss(model(x), y) / accum
                        session.backward(loss)
                session.step(optimizer, clip_grad_norm=clip)
                optimizer.zero_grad(set_to_none=True)

            for _ in range(WARMUP):
                step()
            reads = _count(lambda: [step() for _ in range(MEASURED)], device)
            results.append({"case": f"session {precision} accum={accum} clip={clip}", "reads": dict(reads)})
    return results


def _assert_no_reads(results: list[dict[str, Any]]) -> None:
    offenders = [r for r in results if r["reads"]]
    assert not offenders, "host reads in steady-state steps: " + "; ".join(
        f"{r['case']}: {r['reads']}" for r in offenders)


def test_the_counter_sees_a_host_read() -> None:
    counter = HostReadCounter()
    value = torch.ones(3)
    with counter:
        value.sum().item()
        bool(value.any())
        float(value[0])
    assert counter.reads == Counter({"item": 1, "__bool__": 1, "__float__": 1})


def test_trainer_steps_read_nothing_on_the_host_in_one_process() -> None:
    results = run_ranks(_trainer_reads, 1, TRAINER_CASES, "cpu", device="cpu", threads=1)[0]
    assert len(results) == len(TRAINER_CASES)
    _assert_no_reads(results)


def test_trainer_and_session_steps_read_nothing_on_the_host_on_two_ranks() -> None:
    cases = [c for c in TRAINER_CASES if c[0] in ("mlp", "lm")]
    # The Trainer's steps, then the Session's, in the same two rank processes (one start-up).
    for trainer, session in run_ranks(in_turn, 2, (_trainer_reads, cases, "cpu"), (_session_reads, "cpu"),
                                      device="cpu"):
        _assert_no_reads(trainer)
        assert len(session) == 4
        _assert_no_reads(session)


def test_session_steps_read_nothing_on_the_host_in_one_process() -> None:
    _assert_no_reads(run_ranks(_session_reads, 1, "cpu", device="cpu", threads=1)[0])


@pytest.mark.cuda
def test_steps_on_a_gpu_never_synchronise() -> None:
    _assert_no_reads(run_ranks(_trainer_reads, 1, TRAINER_CASES, "cuda", device="cuda", threads=0)[0])
    _assert_no_reads(run_ranks(_session_reads, 1, "cuda", device="cuda", threads=0)[0])


@pytest.mark.cuda
def test_ddp_over_nccl_on_one_gpu_never_synchronises() -> None:
    cases = [c for c in TRAINER_CASES if c[0] == "mlp"]
    _assert_no_reads(run_ranks(_trainer_reads, 1, cases, "cuda", device="cuda", backend="nccl", threads=0)[0])
