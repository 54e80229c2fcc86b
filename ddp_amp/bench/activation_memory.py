"""Part of section `memory`: what a sharded `lm` model keeps for backward, per checkpointing mode.

One forward of the built-in `lm` task's model (`TransformerLM`, 4 x
`TransformerEncoderLayer` of width 512 and feed-forward 2048, dropout on, vocabulary 1,000,
16 sequences of 256 tokens, fp32) sharded with `--shard` on one rank, with
`--activation-checkpointing` none, selective and full. Activation memory is counted as the
bytes of every tensor storage that the forward allocated and that is still alive when it
returns: what autograd (or checkpointing's selective cache) holds for backward, plus the
logits and loss, the same in every mode. A dispatch mode sees each op's outputs, so the
count is exact on any device and needs no allocator statistics (a CPU has none). Storages
freed within the forward (a unit's gathered weights after it, say) are not counted. The
extra forward time of recomputing is the step's, measured by the trainer, not here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ddp_amp.bench.table import grid
from ddp_amp.distributed import DistContext
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.parallel import ShardOptions
from ddp_amp.session import Session
from ddp_amp.tasks.lm import TransformerLM, lm_loss
from ddp_amp.torch_api import TorchDispatchMode, tree_map

MODES = ("none", "selective", "full")
VOCAB, HEADS, DROPOUT = 1000, 8, 0.2
WIDTH, LAYERS = 512, 4  # the feed-forward is 4 x the width
BATCH, TOKENS = 16, 256


class LiveOutputs(TorchDispatchMode):
    """Remembers the storage of every op output while active; `alive_bytes` sums those still held."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map(self._remember, out)
        return out

    def _remember(self, value: Any) -> None:
        if isinstance(value, torch.Tensor) and not value.is_meta and type(value) is torch.Tensor:
            storage = value.untyped_storage()
            known = self.storages.get(storage.data_ptr())
            if known is None or known[0].expired():  # new, or a freed one's address reused
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def _kept(ctx: DistContext, width: int, layers: int, tokens: int) -> dict[str, int]:
    """Collective (one rank here): the bytes one forward keeps, per checkpointing mode."""
    kept: dict[str, int] = {}
    for mode in MODES:
        with Session("fp32", "cpu", "gloo", environ=os.environ,
                     shard=ShardOptions(activation_checkpointing=mode)) as session:
            torch.manual_seed(0)
            model = session.setup(TransformerLM(VOCAB, width, HEADS, 4 * width, layers, DROPOUT),
                                  units=(torch.nn.TransformerEncoderLayer,))
            inputs = torch.randint(0, VOCAB, (BATCH, tokens + 1))
            counter = LiveOutputs()
            with counter:
                loss = lm_loss(model(inputs[:, :-1]), inputs[:, 1:])
            kept[mode] = counter.alive_bytes()
            loss.backward()  # the recompute runs: checks the mode trains, and frees what was kept
            del model, loss, counter
    return kept


def run(width: int = WIDTH, layers: int = LAYERS, tokens: int = TOKENS) -> dict[str, Any]:
    """The three modes' kept bytes, in a fresh process (a sharded model needs a group)."""
    kept = run_ranks(_kept, 1, width, layers, tokens, backend="gloo", timeout=900)[0]
    rows = [{"mode": mode, "kept": kept[mode], "of_none": kept[mode] / kept["none"]} for mode in MODES]
    return {"width": width, "layers": layers, "batch": BATCH, "tokens": tokens, "rows": rows}


def activation_table(section: dict[str, Any]) -> str:
    """The rows as the bench prints them."""
    title = (f"Kept for backward by one forward of the sharded lm model ({section['layers']} layers of width "
             f"{section['width']}, {section['batch']} x {section['tokens']} tokens, fp32), per "
             "--activation-checkpointing")
    rows = [[row["mode"], f"{row['kept'] / 2**20:.1f}", f"{row['of_none']:.3f}"] for row in section["rows"]]
    return title + "\n" + grid(["mode", "kept MiB", "of none"], rows)
