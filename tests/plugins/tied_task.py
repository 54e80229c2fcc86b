"""A plugin task whose model ties weights: a tiny next-token LM whose output layer is its embedding.

`TiedLM(vocab, width)` is importable on its own, so a test can build the plain module a
checkpoint of this task loads into. The tie is kept through training and saving:
`decoder.weight` and `embedding.weight` are one Parameter, so `model.pt` holds two names
over one storage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp import Task, TrainConfig

VOCAB, WIDTH, SEQ, SAMPLES = 32, 8, 6, 64


class TiedLM(nn.Module):
    """Embedding -> Linear -> logits through the embedding matrix (weight tying)."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.decoder = nn.Linear(width, vocab)
        self.decoder.weight = self.embedding.weight  # tied: one Parameter under two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.hidden(self.embedding(tokens))))


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_task(config: TrainConfig) -> Task:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=generator)
    return Task(model=TiedLM(), train_data=TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                loss_fn=_next_token_loss, default_lr=1e-2, name="tied")
