"""A GPT-2-shaped decoder for the transformer benchmark: the model, its loss and its data.

Pre-norm blocks (LayerNorm, causal self-attention through `scaled_dot_product_attention`,
a 4x GELU MLP), learned positions, the output layer tied to the token embedding, as in
GPT-2. `GPTShape()` is GPT-2 small: 12 layers, width 768, 12 heads, 1024 positions, and
the vocabulary 50257 rounded up to 50304 (a multiple of 64 and of float8's 16, which keeps
the output matmul on fast kernels): 124M parameters. Tokens are synthetic (no download).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTShape:
    """Sizes of the decoder and of one batch."""

    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50304
    sequence: int = 1024
    batch: int = 8

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.sequence


# A few layers and a short sequence: the same code path in seconds on a CPU.
CPU_SHAPE = GPTShape(layers=2, width=64, heads=4, vocab=512, sequence=64, batch=4)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp_in = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head width)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(shape.vocab, shape.width)
        self.position_embedding = nn.Embedding(shape.sequence, shape.width)
        self.blocks = nn.ModuleList(Block(shape.width, shape.heads) for _ in range(shape.layers))
        self.final_norm = nn.LayerNorm(shape.width)
        self.output = nn.Linear(shape.width, shape.vocab, bias=False)
        self.output.weight = self.token_embedding.weight  # tied, as in GPT-2
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                # GPT-2's init: N(0, 0.02), residual projections scaled down by depth.
                std = 0.02 / (2 * shape.layers) ** 0.5 if name.endswith(("attn_out.weight", "mlp_out.weight")) else 0.02
                nn.init.normal_(parameter, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.output(self.final_norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's prediction of the next token."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def seeded_gpt(shape: GPTShape, device: torch.device, seed: int = 0) -> GPT:
    """The decoder with the same initial weights on every call."""
    torch.manual_seed(seed)
    return GPT(shape).to(device)


def token_batches(shape: GPTShape, count: int, device: torch.device,
                  seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (tokens, next tokens) batches of uniformly random ids, made once."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(shape.vocab, (shape.batch, shape.sequence + 1), generator=generator)
        batches.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return batches
