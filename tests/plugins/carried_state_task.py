"""A recurrent task that carries its hidden state from step to step (truncated BPTT).

Each micro-batch is a chunk of token ids; the GRU starts from the hidden state the last
chunk left on this rank (detached, so gradients stop at the chunk), and leaves its own for
the next. The state lives in `Task.state`, so a checkpoint saves every rank's and a resume
gives it back: the run continues bit for bit as if it had never stopped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp import Task, TrainConfig

VOCAB, WIDTH, CHUNK = 32, 16, 12


class Hidden:
    """The GRU's hidden state between steps, on this rank."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        output, hidden = self.gru(self.embed(tokens), hidden)
        return self.out(output), hidden


def make_task(config: TrainConfig) -> Task:
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(VOCAB, (256, CHUNK + 1), generator=generator)
    hidden = Hidden()

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        logits, last = model(tokens, hidden.value)
        hidden.value = last.detach()
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return Task(model=Recurrent(), train_data=TensorDataset(ids[:, :-1], ids[:, 1:]), step_fn=step,
                state=hidden, default_lr=0.05)
