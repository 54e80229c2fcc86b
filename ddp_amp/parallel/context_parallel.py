"""Context parallel: every sequence of a batch split over the mesh's `cp` ranks, attention exact.

A window of L positions is cut into 2N chunks of L / 2N; rank i of the N keeps chunks i and
2N-1-i. Under a causal mask a late query attends to more keys than an early one, so pairing
an early chunk with a late one gives every rank the same attention work (Llama 3's and
torchtitan's load-balanced order).

Attention is the all-gather form: each layer all-gathers the keys and values of the whole
window over the cp ranks (small beside the queries under grouped-query attention), and each
rank attends with its own queries to all of them under the causal mask, and a document mask
where position ids restart inside the window (packed documents with boundaries), as
transformers masks them in one process. In backward the keys' and values' gradients are
summed over the ranks and each keeps its chunks' (a reduce-scatter). The math is that of the
unsplit window, on any backend; the loss is summed over each rank's own target tokens, and
the labels were shifted before the cut, so no target is lost at a chunk's edge.

The batch contract: under context parallel, each tensor of a batch with two or more
dimensions is (batch, sequence, ...) and is cut along dimension 1 (`SequenceSplit.keep`);
the model is given the position ids (the unsplit window's positions of each kept token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ddp_amp.errors import UsageError
from ddp_amp.hf import use_attention
from ddp_amp.torch_api import tree_map

ATTENTION_NAME = "ddp_amp_context_parallel"


def chunk_order(length: int, degree: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of a window of `length` as the `degree` ranks hold them, rank 0's first:
    rank i holds chunks i and 2N-1-i of 2N."""
    chunk = length // (2 * degree)
    chunks = torch.arange(length, device=device).view(2 * degree, chunk)
    return torch.cat([torch.cat([chunks[i], chunks[2 * degree - 1 - i]]) for i in range(degree)])


def check_length(length: int, degree: int, flag: str = "--context-parallel") -> None:
    """A window length the load-balanced cut divides evenly (2 x degree chunks)."""
    if length % (2 * degree):
        multiple = 2 * degree
        raise UsageError(flag, degree, f"a sequence length divisible by 2 x {degree} = {multiple} (each rank "
                         f"keeps 2 of {multiple} equal chunks; this batch's sequences have {length} positions)",
                         f"make the windows a multiple of {multiple} long, e.g. --task-opt max_length="
                         f"{max(multiple, length // multiple * multiple)}")


@dataclass
class SequenceSplit:
    """This rank's part of every sequence: `degree` ranks of the cp group `group`, this one `rank`."""

    degree: int
    rank: int
    group: dist.ProcessGroup | None = field(repr=False)
    _positions: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)
    _orders: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The window positions this rank keeps, in its order (cached per length and device)."""
        key = (length, str(device))
        if key not in self._positions:
            check_length(length, self.degree)
            part = length // self.degree
            self._positions[key] = chunk_order(length, self.degree, device)[self.rank * part:(self.rank + 1) * part]
        return self._positions[key]

    def window_order(self, length: int, device: torch.device) -> torch.Tensor:
        """Where each position of the window lies among the ranks' parts gathered in rank order
        (the inverse of `chunk_order`), cached per length and device."""
        key = (length, str(device))
        if key not in self._orders:
            self._orders[key] = torch.argsort(chunk_order(length, self.degree, device))
        return self._orders[key]

    def keep(self, batch: Any) -> Any:
        """`batch` with each tensor of 2 or more dimensions cut to this rank's positions along
        dimension 1 (its sequence); other leaves as they are."""
        def cut(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or leaf.dim() < 2:
                return leaf
            return leaf.index_select(1, self.positions(leaf.shape[1], leaf.device))
        return tree_map(cut, batch)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dimension 2 (the sequence of a (batch, heads, sequence, size) tensor) in
    forward; in backward the gathered gradient summed over the ranks, this rank's part kept."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
        ctx.group, ctx.degree = group, degree
        parts = [torch.empty_like(part) for _ in range(degree)]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rank, degree = dist.get_rank(ctx.group), ctx.degree
        chunks = [piece.contiguous() for piece in grad.chunk(degree, dim=2)]
        if dist.get_backend(ctx.group) == "nccl":
            own = torch.empty_like(chunks[rank])
            dist.reduce_scatter(own, chunks, group=ctx.group)
            return own, None, None
        # gloo has no reduce-scatter: the whole gradient summed, this rank's part kept
        whole = grad.contiguous()
        dist.all_reduce(whole, group=ctx.group)
        return whole.chunk(degree, dim=2)[rank].contiguous(), None, None


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(batch, length) position ids -> the document each position belongs to: a new one where
    the positions do not go on by one (transformers' reading of packed position ids)."""
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


class ContextAttention:
    """A transformers attention function over the cp group: queries of this rank's two chunks,
    keys and values of the whole window (gathered), the causal and document masks of the
    unsplit window. The gathered keys are put back in window order, and each chunk's queries
    attend only to the keys up to the chunk's own end (every later key is masked for all of
    them): chunk c against the first c + 1 chunks. Half the mask, and half the attention, of
    one rectangle over the window. The masks are made once per forward (every layer gets the
    same position ids tensor) and reused by the layers after the first."""

    def __init__(self, split: SequenceSplit) -> None:
        self.split = split
        self._masked_for: torch.Tensor | None = None
        self._masks: list[torch.Tensor] = []
        self.gathered_bytes = 0  # the keys and values gathered so far (what `python -m ddp_amp.bench` reports)

    def chunks(self) -> tuple[int, int]:
        """The two chunks of 2N this rank holds, in its order."""
        return self.split.rank, 2 * self.split.degree - 1 - self.split.rank

    def masks(self, given: torch.Tensor, batch: int, length: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """For each of this rank's chunks, (batch, 1, chunk, chunk's end) in `dtype`: 0 where a
        query may attend a key, -inf where not, keys in window order from the first, for the
        position ids `given` to the model. One tensor per chunk for every layer of a forward: the
        attention kernels keep their mask for backward, and one in the queries' dtype is kept as
        it is (a bool one is converted, and kept, per layer)."""
        if self._masked_for is given and self._masks and self._masks[0].dtype == dtype:
            return self._masks
        split, device = self.split, given.device
        local_positions = given.expand(batch, -1)
        gathered = [torch.empty_like(local_positions) for _ in range(split.degree)]
        dist.all_gather(gathered, local_positions.contiguous(), group=split.group)
        natural = local_positions.new_empty(batch, length)
        natural[:, chunk_order(length, split.degree, device)] = torch.cat(gathered, dim=1)
        documents = document_ids(natural)
        size = length // (2 * split.degree)
        masks = []
        for chunk in self.chunks():
            start, end = chunk * size, (chunk + 1) * size
            queries, keys = torch.arange(start, end, device=device), torch.arange(end, device=device)
            allowed = (keys[None, :] <= queries[:, None])[None] & (documents[:, start:end, None] ==
                                                                   documents[:, None, :end])
            masks.append(torch.zeros(allowed.shape, dtype=dtype, device=device)
                         .masked_fill_(~allowed, float("-inf"))[:, None])
        self._masked_for, self._masks = given, masks
        return masks

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        positions = kwargs.get("position_ids")
        if positions is None:
            raise UsageError("--context-parallel", self.split.degree, "position ids given to the model (each kept "
                             "token's position in the unsplit window)",
                             "call the model with position_ids=, cut with the batch (Session.split_sequences)")
        split = self.split
        keys = _GatherSequence.apply(key, split.group, split.degree)
        values = _GatherSequence.apply(value, split.group, split.degree)
        self.gathered_bytes += keys.nbytes + values.nbytes
        length = keys.shape[2]
        in_window_order = split.window_order(length, keys.device)
        keys, values = keys.index_select(2, in_window_order), values.index_select(2, in_window_order)
        size = length // (2 * split.degree)
        # grouped-query attention: each key head serves several query heads, without copies
        grouped = keys.shape[1] != query.shape[1]
        parts = []
        for part, (chunk, mask) in enumerate(zip(self.chunks(), self.masks(positions, query.shape[0], length,
                                                                           query.dtype))):
            end = (chunk + 1) * size
            parts.append(F.scaled_dot_product_attention(query[:, :, part * size:(part + 1) * size], keys[:, :, :end],
                                                        values[:, :, :end], attn_mask=mask, dropout_p=dropout,
                                                        scale=scaling, enable_gqa=grouped))
        return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def split_attention(model: nn.Module, split: SequenceSplit, flag: str = "--context-parallel") -> ContextAttention:
    """Route every attention layer of `model` (a transformers model) through the all-gather
    form over `split`'s ranks; the function, for a caller that keeps it."""
    function = ContextAttention(split)
    use_attention(model, ATTENTION_NAME, function, flag, split.degree)
    return function
