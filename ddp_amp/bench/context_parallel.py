"""Section `cp`: what a rank holds of one long window of a small transformers Llama split over 1, 2
and 4 ranks (context parallel), what the split attention gathers, and the longest window that
fits a budget at each degree.

Each row is one degree on fresh gloo ranks, the model whole on every rank (only the sequence is
split: what context parallelism changes), fp32, one window with its position ids:

- activations: the bytes of the tensors autograd saves for backward in one forward and loss
  (each storage once, `SavedForBackward`: the tensor-parallel section's meter), weights left out;
  the largest over the ranks;
- gathered: the bytes of the keys and values each rank's attention layers gathered in that
  forward (counted by the attention function); a step moves as much again in backward, where
  their gradients are summed back (a reduce-scatter);
- attention FLOPs: each rank's queries against the keys up to each of its chunks' end, forward
  and backward (3 x the forward's 2 matmuls of 2 x H x D a query-key pair: the masked kernel
  computes every pair of those rectangles, (2N + 1) chunk squares; unsplit, the causal half of
  the window's square), and the FLOPs per byte gathered;
- mask: what of the activations falls as the square of the window, not linearly: the attention
  masks of a rank's two chunks against the keys up to each one's end, (2N + 1) chunk squares
  (about L^2 / 2N) in the queries' dtype, made once per forward (not per layer);
- longest window: the longest of the windows tried, doubling from 1,024 tokens, whose
  activations per rank fit `budget_mib` (measured at each length, not extrapolated).

Target (checked from 4,096 tokens): at N ranks the activations per rank are at most
TARGET_ACTIVATIONS[N] of one rank's: 1/N, plus the gathered keys and values and the mask. The
mask is about L^2/2N against activations linear in L and in the layers, so the default shape has the
layers and width that keep it a modest share at 8,192 tokens, as a real model's many layers do.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import checks_cell, target_fields
from ddp_amp.bench.tensor_parallel import SavedForBackward
from ddp_amp.distributed import DistContext
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.parallel import SequenceSplit, split_attention

DEGREES = (1, 2, 4)
TARGET_ACTIVATIONS = {2: 0.6, 4: 0.35}
MEASURABLE_TOKENS = 4096  # shorter, what every rank holds whole (the model's buffers, the process) weighs in
FIRST_TRIED = 1024


@dataclass(frozen=True)
class WindowShape:
    """A small Llama (grouped-query heads, as Llama 3's) and the window measured."""

    width: int = 512
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 4096
    tokens: int = 8192
    budget_mib: int = 1024
    longest_tried: int = 32768


def _llama(shape: WindowShape, positions: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.width, intermediate_size=4 * shape.width,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=positions, use_cache=False)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"  # the unsplit window's kernel; a split replaces it
    return model


def _held(ctx: DistContext, shape: WindowShape, tokens: int) -> dict[str, int]:
    """Collective: this rank's saved bytes and gathered bytes for one forward and loss of a window
    of `tokens`, split over the world (whole where it is one rank)."""
    torch.manual_seed(0)
    model = _llama(shape, tokens)
    ids = torch.randint(0, shape.vocab, (1, tokens + 1), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(tokens)[None]}
    attention = None
    if ctx.world_size > 1:
        split = SequenceSplit(ctx.world_size, ctx.rank, dist.group.WORLD)
        attention = split_attention(model, split)
        batch = split.keep(batch)
    saved = SavedForBackward(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
    kept = saved.alive_bytes()
    del loss, logits, saved
    return {"activations": kept, "gathered": attention.gathered_bytes if attention is not None else 0}


def _rectangles(tokens: int, degree: int) -> float:
    """The query x key pairs a rank's attention computes: chunk c of 2N against the first c + 1
    chunks, for its two chunks (2N + 1 chunk squares); unsplit, the causal half of the square."""
    if degree == 1:
        return tokens * tokens / 2
    chunk = tokens / (2 * degree)
    return chunk * chunk * (2 * degree + 1)


def _attention_flops(shape: WindowShape, tokens: int, degree: int) -> float:
    """Forward and backward (3 x the forward's 2 matmuls, 2 FLOPs a multiply-add) over the pairs."""
    return 3 * 2 * 2 * shape.heads * (shape.width // shape.heads) * _rectangles(tokens, degree)


def _measure(shape: WindowShape, degree: int, tokens: int) -> dict[str, int]:
    held = run_ranks(_held, degree, shape, tokens, timeout=3600)
    return {"activations": max(rank["activations"] for rank in held),
            "gathered": max(rank["gathered"] for rank in held)}


def run(shape: WindowShape | None = None) -> dict[str, Any]:
    """Each degree at the shape's window, then its longest window within the budget."""
    shape = shape or WindowShape()
    try:
        import transformers  # noqa: F401  # the Llama is transformers'
    except ImportError:
        return {"skipped": "transformers is not installed (pip install 'ddp_amp[hf]')"}
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N ranks on one host's cores
    rows: list[dict[str, Any]] = []
    for degree in DEGREES:
        measured = _measure(shape, degree, shape.tokens)
        flops = _attention_flops(shape, shape.tokens, degree)
        row: dict[str, Any] = {"ranks": degree, **measured, "attention_flops": flops,
                               "mask": int(_rectangles(shape.tokens, degree)) * 4 if degree > 1 else 0,
                               "flops_per_gathered_byte": flops / (2 * measured["gathered"]) if measured["gathered"]
                               else None}
        row["activations_ratio"] = measured["activations"] / rows[0]["activations"] if rows else 1.0
        if degree in TARGET_ACTIVATIONS:
            short = (f"a window of {shape.tokens} tokens is too short to hold to it" if shape.tokens < MEASURABLE_TOKENS
                     else "")
            row["target_checks"] = [target_fields("activations / one rank's", row["activations_ratio"],
                                                  TARGET_ACTIVATIONS[degree], not_here=short)]
        row["longest_within_budget"] = _longest(shape, degree, measured["activations"])
        rows.append(row)
    return {"shape": asdict(shape), "rows": rows}


def _longest(shape: WindowShape, degree: int, at_shape_tokens: int) -> int:
    """The longest window tried (doubling from FIRST_TRIED) whose activations per rank fit the
    budget; 0 where the first does not."""
    budget, fits, tokens = shape.budget_mib * 2**20, 0, FIRST_TRIED
    while tokens <= shape.longest_tried:
        held = at_shape_tokens if tokens == shape.tokens else _measure(shape, degree, tokens)["activations"]
        if held > budget:
            break
        fits, tokens = tokens, tokens * 2
    return fits


def cp_table(section: dict[str, Any]) -> str:
    if "skipped" in section:
        return f"cp: not run: {section['skipped']}"
    shape = section["shape"]
    title = (f"Context parallel: per rank, one window of {shape['tokens']} tokens of a Llama of width "
             f"{shape['width']}, {shape['layers']} layers, {shape['heads']} heads ({shape['kv_heads']} key/value), "
             f"fp32, the model whole on every rank; the longest window (doubling from {FIRST_TRIED}) within "
             f"{shape['budget_mib']} MiB of activations")
    rows = [[row["ranks"], row["activations"] / 2**20, row["activations_ratio"], row["mask"] / 2**20,
             row["gathered"] / 2**20,
             row["attention_flops"] / 1e9, row["flops_per_gathered_byte"] or "-", row["longest_within_budget"],
             checks_cell(row)]
            for row in section["rows"]]
    return title + "\n" + grid(["ranks", "activations MiB", "/ one rank", "of which mask MiB", "gathered MiB (fwd)",
                                "attention GFLOP", "FLOP / byte moved", "longest window", "targets"], rows)
