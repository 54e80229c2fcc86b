"""Section `tp`: what a rank holds of a transformers Llama split over 1, 2 and 4 ranks, against the
same model sharded over as many.

Each row is one layout on fresh gloo ranks: split (`tensor_parallel=N`, the model's own plan,
sequence and loss parallel) or sharded (`ShardOptions()`, FSDP2), built as a run builds it
(`Session.build_model`: each rank builds only its part). Per rank, the largest over ranks:

- parameters: the bytes of its parts of the parameters (DTensor local shards);
- activations: the bytes of the tensors autograd saves for backward in one forward and loss
  (each storage once, seen by `saved_tensors_hooks`), the weights' storages left out (a
  matmul saves a view of its weight, whole where FSDP2 gathered it), for the same
  micro-batch on every layout (split over the vocabulary under loss parallel).

Sharding divides the parameters and leaves each rank a whole micro-batch's activations; a
split divides both. Targets (checked on any device, from a
width of 1024): the parameters of a split over N ranks at most 1.15/N of one rank's, and its
activations at most TARGET_ACTIVATIONS[N] of one rank's.

The default shape is Llama 3.2 1B's (1.24B parameters); the tests' run uses a small one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import checks_cell, target_fields
from ddp_amp.distributed import DistContext
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.parallel import ShardOptions
from ddp_amp.session import Session
from ddp_amp.torch_api import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

DEGREES = (2, 4)
TARGET_PARAMETERS = 1.15  # times 1/N
# Measured 0.445 (2) and 0.242 (4) on the 1B shape, 128 tokens (docs/benchmarks.md, 2026-12-06).
TARGET_ACTIVATIONS = {2: 0.6, 4: 0.35}
MEASURABLE_WIDTH = 1024  # narrower, what every rank holds whole is most of the figure


@dataclass(frozen=True)
class LlamaShape:
    """A Llama's sizes (Llama 3.2 1B's by default) and the tokens of the micro-batch measured."""

    width: int = 2048
    intermediate: int = 8192
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    batch: int = 1
    tokens: int = 128

    @classmethod
    def of(cls, width: int, layers: int, vocab: int, tokens: int) -> LlamaShape:
        """Llama 3.2 1B's proportions at `width`: heads of 64 (at least 8), a quarter as many
        key/value heads (at least 4, so 4 ranks split them), a feed-forward of 4 x the width."""
        heads = max(8, width // 64)
        return cls(width, 4 * width, layers, heads, max(4, heads // 4), vocab, 1, tokens)


class SavedForBackward:
    """The storages of what autograd saves for backward while its hooks are active, the
    weights' storages left out: each module's parameters as its forward starts (after FSDP2
    gathered them), of which the matmuls save views."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.weights: set[int] = set()
        self._hooks = [module.register_forward_pre_hook(self._weights_of) for module in model.modules()]

    def _weights_of(self, module: torch.nn.Module, args: Any) -> None:
        for param in module.parameters(recurse=False):
            address = _address(param.to_local() if isinstance(param, DTensor) else param)
            if address is not None:
                self.weights.add(address)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        address = _address(local)
        if address is not None and address not in self.weights:
            self.storages[address] = (StorageWeakRef(local.untyped_storage()), local.untyped_storage().nbytes())
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def alive_bytes(self) -> int:
        for hook in self._hooks:
            hook.remove()
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def _address(tensor: torch.Tensor) -> int | None:
    """Where `tensor`'s storage lies; None for a meta tensor or a storage FSDP2 freed."""
    if tensor.is_meta:
        return None
    with contextlib.suppress(RuntimeError):  # a freed storage's python handle is gone
        return int(tensor.untyped_storage().data_ptr())
    return None


def _llama(shape: LlamaShape) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.width, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=max(shape.tokens, 128),
                         tie_word_embeddings=True, use_cache=False)
    return LlamaForCausalLM(config)


def _held(ctx: DistContext, shape: LlamaShape, split: int) -> dict[str, int]:
    """Collective: this rank's parameter bytes and the bytes one forward keeps, split over
    `split` ranks, or sharded over every rank where `split` is 1."""
    tensor_parallel = split if split > 1 else 1
    shard = ShardOptions() if split == 1 and ctx.world_size > 1 else None
    with Session("fp32", "cpu", "gloo", environ=os.environ, shard=shard, tensor_parallel=tensor_parallel) as session:
        torch.manual_seed(0)
        model = session.setup(session.build_model(lambda: _llama(shape)))
        parameters = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                         for p in model.parameters())
        ids = torch.randint(0, shape.vocab, (shape.batch, shape.tokens + 1), generator=torch.Generator().manual_seed(1))
        saved = SavedForBackward(model)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), session.loss_parallel():
            logits = model(input_ids=ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        kept = saved.alive_bytes()
        # No backward: its gradients, and a sharded root's whole embedding gathered meanwhile,
        # would put 4 ranks of the 1B shape past a 24 GiB host; the tests train every layout.
        del model, loss, logits, saved
    return {"parameters": parameters, "activations": kept}


def run(shape: LlamaShape | None = None) -> dict[str, Any]:
    """One rank whole, then each degree split and sharded, each in fresh processes."""
    shape = shape or LlamaShape()
    try:
        import transformers  # noqa: F401  # the Llama is transformers'
    except ImportError:
        return {"skipped": "transformers is not installed (pip install 'ddp_amp[hf]')"}
    alone = run_ranks(_held, 1, shape, 1, timeout=3600)[0]
    rows: list[dict[str, Any]] = [{"layout": "one rank", "ranks": 1, **alone}]
    for degree in DEGREES:
        for layout, split in (("sharded", 1), ("split", degree)):
            held = run_ranks(_held, degree, shape, split, timeout=3600)
            row: dict[str, Any] = {"layout": layout, "ranks": degree,
                                   "parameters": max(rank["parameters"] for rank in held),
                                   "activations": max(rank["activations"] for rank in held)}
            row["parameters_ratio"] = row["parameters"] / alone["parameters"]
            row["activations_ratio"] = row["activations"] / alone["activations"]
            if layout == "split":
                small = (f"a width of {shape.width} is too small to hold to it (norms, positions and the "
                         "process's own allocations are most of it)") if shape.width < MEASURABLE_WIDTH else ""
                row["target_checks"] = [
                    target_fields("parameters / one rank's x N", row["parameters_ratio"] * degree, TARGET_PARAMETERS,
                                  not_here=small),
                    target_fields("activations / one rank's", row["activations_ratio"], TARGET_ACTIVATIONS[degree],
                                  not_here=small)]
            rows.append(row)
    return {"shape": asdict(shape), "rows": rows}


def tp_table(section: dict[str, Any]) -> str:
    if "skipped" in section:
        return f"tp: not run: {section['skipped']}"
    shape = section["shape"]
    title = (f"Tensor parallel: per rank, a Llama of width {shape['width']}, {shape['layers']} layers, vocabulary "
             f"{shape['vocab']}, fp32, one forward of {shape['batch']} x {shape['tokens']} tokens; split (sequence "
             "and loss parallel) against sharded (FSDP2) over as many ranks")
    rows = [[row["layout"], row["ranks"], row["parameters"] / 2**20, row.get("parameters_ratio", 1.0),
             row["activations"] / 2**20, row.get("activations_ratio", 1.0),
             checks_cell(row)]
            for row in section["rows"]]
    return title + "\n" + grid(["layout", "ranks", "params MiB", "/ one rank", "activations MiB", "/ one rank",
                                "targets"], rows)
