"""Part of section `memory`: the peak host memory of each rank while a model is built and sharded.

Two models, each world and way in fresh processes (gloo on CPU):

- a stack of `layers` Linear(width, width) layers (about 510M parameters, 1.9 GiB in fp32,
  at the default width 4608 and 24 layers) on 1, 2 and 4 ranks, two ways:
  - whole, then sharded: `factory()` on every rank, then `Session.setup` (a task that
    passes `model=`): every rank holds the whole fp32 model before it is sharded;
  - built sharded: `Session.build_model(factory)` (a task's `build_model=`), then `setup`;
- a transformers `LlamaForCausalLM` (hidden 2048, 16 layers, MLP 8192, 32 heads of which 8
  key/value heads, a 32,000-word vocabulary tied to the head: 1.04B parameters, 3.9 GiB in
  fp32), built sharded on 4 ranks `runs` times, where transformers is installed: a real
  architecture's init (each Linear drawn twice, once by torch and once by transformers, the
  embedding and the head a 250 MiB tensor each); and once split over 2 ranks and sharded over
  2 (`tensor_parallel=2`, the model's own plan: each rank builds its part of each split
  parameter's rows or columns, then of FSDP2's rows).

Per rank it reads the resident memory just before the build (the process's baseline:
Python, torch, the process group, the model's modules imported and a tiny one built) and
the peak resident memory after setup (`getrusage`'s `ru_maxrss`, the most this process ever
held), and reports the peak's growth over the baseline against 1/N of the model's fp32
bytes. Target, built sharded: at most 1.3 x that share on every rank of every run. Where the
share is under 64 MiB the figure is shown but not held to it: the process's own first-use
costs (tens of MiB) would be most of what is measured.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
from torch import nn

from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import target_fields
from ddp_amp.distributed import BackendChoice, DeviceChoice, DistContext, local_numel_bytes
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.parallel import ShardOptions
from ddp_amp.session import Session
from ddp_amp.tasks.mlp import make_model
from ddp_amp.torch_api import TENSOR_PARALLEL

WIDTH, LAYERS = 4608, 24
RANKS = (1, 2, 4)
LLAMA_WIDTH, LLAMA_LAYERS, LLAMA_RANKS, RUNS = 2048, 16, 4, 3
TARGET = 1.3  # peak growth per rank / (fp32 model bytes / N), built sharded, every rank
MEASURABLE = 64 * 2**20  # bytes of share below which the first-use costs dominate the figure
WAYS = {"whole, then sharded": False, "built sharded": True}
FIGURE = "peak growth / (fp32 model / N), largest rank"


def llama(width: int, layers: int, vocab: int = 32000) -> nn.Module:
    """A Llama-3.2-1B-shaped transformers model (any width divisible by 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=max(2, width // 64),
                         num_key_value_heads=max(2, width // 256), tie_word_embeddings=True, use_cache=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


def _factory(model: str, width: int, layers: int, vocab: int = 32000) -> Callable[[], nn.Module]:
    if model == "llama":
        return lambda: llama(width, layers, vocab)
    return lambda: make_model(width, width, width, layers)


def _peak(ctx: DistContext, model: str, width: int, layers: int, built_sharded: bool,
          tensor_parallel: int = 1) -> dict[str, Any]:
    """Collective: build and shard (or split and shard) the model one way; this rank's baseline,
    peak, shard bytes and build time."""
    device: DeviceChoice = "cuda" if ctx.device.type == "cuda" else "cpu"
    backend: BackendChoice = "nccl" if ctx.backend == "nccl" else "gloo"
    factory = _factory(model, width, layers)
    _factory(model, 256, 1, vocab=256)()  # the model's modules imported and first used before the baseline
    with Session("fp32", device, backend, environ=os.environ, shard=ShardOptions(),
                 tensor_parallel=tensor_parallel) as session:
        gc.collect()
        baseline = psutil.Process().memory_info().rss
        torch.manual_seed(0)
        started = time.perf_counter()
        built = session.build_model(factory) if built_sharded else factory()
        wrapped = session.setup(built, units=(nn.Linear,) if model == "stack" else None)
        seconds = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        held = local_numel_bytes(session.unwrap(wrapped).parameters())
        parameters = sum(p.numel() for p in session.unwrap(wrapped).parameters())
        del wrapped, built
    return {"baseline": baseline, "peak": peak, "held": held, "parameters": parameters, "seconds": seconds}


def _row(per_rank: list[dict[str, Any]], world: int, built_sharded: bool, **identity: Any) -> dict[str, Any]:
    share = per_rank[0]["parameters"] * 4 / world
    of_share = [max(0, rank["peak"] - rank["baseline"]) / share for rank in per_rank]
    row: dict[str, Any] = {"ranks": world, **identity, "baseline": max(rank["baseline"] for rank in per_rank),
                           "growth": max(max(0, rank["peak"] - rank["baseline"]) for rank in per_rank),
                           "held": max(rank["held"] for rank in per_rank), "of_share": max(of_share),
                           "of_share_per_rank": of_share, "seconds": max(rank["seconds"] for rank in per_rank)}
    if built_sharded:
        too_small = f"a share of {share / 2**20:.1f} MiB is too small to measure" if share < MEASURABLE else ""
        row.update(target_fields(FIGURE, row["of_share"], TARGET, not_here=too_small))
    return row


def run(device: str, width: int = WIDTH, layers: int = LAYERS, ranks: tuple[int, ...] = RANKS,
        llama_width: int = LLAMA_WIDTH, llama_layers: int = LLAMA_LAYERS, runs: int = RUNS) -> dict[str, Any]:
    """The stack's two rows per world size, then the Llama's row per run (none for 0 runs or
    layers), each world and run in fresh processes."""
    backend = "nccl" if device == "cuda" else "gloo"
    rows: list[dict[str, Any]] = []
    for world in ranks:
        if device == "cuda" and world > torch.cuda.device_count():
            rows.append({"ranks": world, "skipped": f"needs {world} GPUs, {torch.cuda.device_count()} visible"})
            continue
        for variant, built_sharded in WAYS.items():
            per_rank = run_ranks(_peak, world, "stack", width, layers, built_sharded, device=device,
                                 backend=backend, timeout=900)
            rows.append(_row(per_rank, world, built_sharded, variant=variant))
    llama_rows: list[dict[str, Any]] = []
    for index in range(runs if llama_layers else 0):
        name = f"run {index + 1}"
        if device == "cuda" and torch.cuda.device_count() < LLAMA_RANKS:
            llama_rows.append({"name": name, "skipped": f"needs {LLAMA_RANKS} GPUs"})
        elif not _has_transformers():
            llama_rows.append({"name": name, "skipped": "transformers is not installed"})
        else:
            per_rank = run_ranks(_peak, LLAMA_RANKS, "llama", llama_width, llama_layers, True, device=device,
                                 backend=backend, timeout=1800)
            llama_rows.append(_row(per_rank, LLAMA_RANKS, True, name=name, variant="built sharded"))
    if llama_layers and runs and _has_transformers() and device == "cpu" and TENSOR_PARALLEL.available():
        per_rank = run_ranks(_peak, LLAMA_RANKS, "llama", llama_width, llama_layers, True, 2, device=device,
                             backend=backend, timeout=1800)
        llama_rows.append(_row(per_rank, LLAMA_RANKS, True, name="split 2 x sharded 2", variant="built split"))
    return {"width": width, "layers": layers, "parameters": layers * (width * width + width),
            "model_bytes": layers * (width * width + width) * 4, "rows": rows,
            "llama": {"width": llama_width, "layers": llama_layers, "rows": llama_rows}}


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _cells(row: dict[str, Any]) -> list[Any]:
    per_rank = " ".join(f"{value:.3f}" for value in row.get("of_share_per_rank", ()))
    return [*(f"{row[key] / 2**20:.0f}" if key in row else "" for key in ("baseline", "growth", "held")),
            f"{row['of_share']:.3f}" if "of_share" in row else "", per_rank,
            f"{row['seconds']:.0f}" if "seconds" in row else ""]


def build_table(section: dict[str, Any]) -> str:
    """The rows as the bench prints them, MiB per rank."""
    title = (f"Peak host memory per rank while {section['layers']} x Linear({section['width']},{section['width']}) "
             f"({section['parameters'] / 1e6:.0f}M parameters, {section['model_bytes'] / 2**20:.0f} MiB fp32) is "
             "built and sharded: growth over the process's baseline")
    header = ["baseline MiB", "peak growth MiB", "shards held MiB", "growth / (model / N)", "each rank", "build s"]
    rows = [[row["ranks"], row.get("variant", row.get("skipped")), *_cells(row)] for row in section["rows"]]
    text = title + "\n" + grid(["ranks", "way", *header], rows)
    llama_section = section.get("llama", {})
    if llama_section.get("rows"):
        shape = f"hidden {llama_section['width']}, {llama_section['layers']} layers"
        llama_rows = [[row["name"], row.get("skipped", row.get("ranks")), *_cells(row)]
                      for row in llama_section["rows"]]
        text += (f"\n\ntransformers LlamaForCausalLM ({shape}), built sharded on {LLAMA_RANKS} ranks, each run "
                 "in fresh processes\n" + grid(["run", "ranks", *header], llama_rows))
    return text
