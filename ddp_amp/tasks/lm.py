"""`lm`: the PyTorch transformer language-model example, on text that ships with Python.

A small `nn.TransformerEncoder` with a causal mask predicts the next word of chunks of
`bptt` words; cross-entropy loss, SGD at lr 5.0, StepLR with gamma 0.95 once per epoch,
gradient clipping at 0.5. The corpus is `pydoc_data.topics`: the Python language
reference as English text, part of the standard library, so no download is ever needed.
The last 10% of the word stream is held out; the metric is perplexity (exp of mean NLL).

Task options (`--task-opt KEY=VALUE`): emsize, nhid, nlayers, nhead, bptt, vocab (keep the
N most frequent words, 0 = all), tokens (use only the first N words, 0 = all); dropout
(a float).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_amp.parallel import fused_kernel_takes
from ddp_amp.errors import UsageError
from ddp_amp.tasks import parse_task_options

if TYPE_CHECKING:
    from ddp_amp.config import TrainConfig
    from ddp_amp.tasks import Task

MAX_POSITIONS = 4096  # the longest sequence the positional table covers
# --tensor-parallel: the feed-forward of each layer (Megatron's MLP split), the embedding and the
# head (its logits split over the vocabulary for the loss). The attention stays whole on every
# rank: torch's MultiheadAttention packs query, key and value in one weight.
TENSOR_PARALLEL_PLAN = {"embedding": "embedding", "encoder.layers.*.linear1": "colwise",
                        "encoder.layers.*.linear2": "rowwise", "decoder": "head"}

# The example's sizes (emsize 200, nhid 200, 2 layers, 2 heads, dropout 0.2, bptt 35).
DEFAULTS: dict[str, float] = {"emsize": 200, "nhid": 200, "nlayers": 2, "nhead": 2, "bptt": 35,
                              "vocab": 0, "tokens": 0, "dropout": 0.2}
HELD_OUT = 0.1
UNK, EOS = "<unk>", "<eos>"
_WORD = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


def corpus_text() -> str:
    """The Python reference documentation as one string, in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some distributions strip pydoc_data out of the stdlib
        raise UsageError("--task", "lm", "a Python with the standard-library module pydoc_data",
                         "install your distribution's full Python standard library") from error
    return "\n".join(topics[key] for key in sorted(topics))


def tokenize(text: str) -> list[str]:
    """Lower-case words, numbers and single punctuation marks; `<eos>` ends each line."""
    words: list[str] = []
    for line in text.lower().splitlines():
        line_words = _WORD.findall(line)
        if line_words:
            words += line_words + [EOS]
    return words


def build_vocab(words: list[str], limit: int) -> dict[str, int]:
    """Word -> id, most frequent first (ties by word, so every rank agrees); id 0 is <unk>."""
    counts = Counter(words)
    ranked = sorted(counts, key=lambda word: (-counts[word], word))
    if limit:
        ranked = ranked[:limit - 1]
    return {word: index for index, word in enumerate([UNK] + [w for w in ranked if w != UNK])}


class ChunkDataset(Dataset):
    """Item i: `bptt` token ids starting at i * bptt, and the same shifted by one word."""

    def __init__(self, ids: torch.Tensor, bptt: int) -> None:
        self.ids, self.bptt = ids, bptt
        self.count = (len(ids) - 1) // bptt

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.bptt
        return self.ids[start:start + self.bptt], self.ids[start + 1:start + 1 + self.bptt]


class PositionalEncoding(nn.Module):
    """Fixed sinusoidal position signal added to the embeddings (as in the example)."""

    def __init__(self, width: int, dropout: float, max_len: int = MAX_POSITIONS) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        position = torch.arange(max_len).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        table = torch.zeros(max_len, width)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency[: width // 2])
        # A buffer, not a parameter: moves with .to(device), is never trained.
        self.table: torch.Tensor
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.table[: x.shape[1]])


class TransformerLM(nn.Module):
    """Embedding -> positions -> causal TransformerEncoder -> Linear to vocabulary logits."""

    def __init__(self, ntoken: int, emsize: int, nhead: int, nhid: int, nlayers: int,
                 dropout: float) -> None:
        super().__init__()
        self.emsize = emsize
        self.embedding = nn.Embedding(ntoken, emsize)
        self.positions = PositionalEncoding(emsize, dropout)
        layer = nn.TransformerEncoderLayer(emsize, nhead, nhid, dropout, batch_first=True)
        # enable_nested_tensor only matters for padding masks, which a causal LM never has.
        self.encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.decoder = nn.Linear(emsize, ntoken)
        for weight in (self.embedding.weight, self.decoder.weight):
            nn.init.uniform_(weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, ntoken); position t sees only <= t."""
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.positions(self.embedding(tokens) * math.sqrt(self.emsize))
        return self.decoder(self.encoder(hidden, mask=mask, is_causal=True))


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-word cross-entropy over every position of the batch."""
    return nn.functional.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def lm_metric(output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """Summed NLL and word count; `perplexity` turns the reduced mean into ppl."""
    nll = nn.functional.cross_entropy(output.flatten(0, 1).float(), target.flatten(), reduction="sum")
    return {"nll": (nll, target.numel())}


def perplexity(means: dict[str, float]) -> dict[str, float]:
    """Add perplexity = exp(mean NLL) to the reduced metrics."""
    return {**means, "ppl": math.exp(min(means["nll"], 700.0))}  # 700: exp() stays finite


def read_options(options: dict[str, str]) -> dict[str, float]:
    values = parse_task_options(options, DEFAULTS)
    for key, raw in options.items():
        low = 0 if key in ("vocab", "tokens", "dropout") else 1
        if values[key] < low or (key == "dropout" and values[key] >= 1):
            raise UsageError(f"--task-opt {key}", raw, f"a number >= {low}" + (" and < 1" if key == "dropout" else ""),
                             f"e.g. --task-opt {key}={DEFAULTS[key]:g}")
    if values["bptt"] > MAX_POSITIONS:
        raise UsageError("--task-opt bptt", int(values["bptt"]), f"at most {MAX_POSITIONS} (the model's "
                         "positional table)", f"e.g. --task-opt bptt={DEFAULTS['bptt']:g}")
    if values["emsize"] % values["nhead"]:
        raise UsageError("--task-opt nhead", int(values["nhead"]), f"a divisor of emsize={int(values['emsize'])}",
                         "attention splits emsize evenly over the heads")
    return values


def make_sgd(params: Iterable[torch.Tensor], lr: float) -> torch.optim.SGD:
    """Fused SGD: it takes the scaler's skip flag on the device, where a plain SGD makes the
    scaler read the flag on the host every fp16 step (sharded parameters have no fused SGD)."""
    params = list(params)  # read twice: a generator would be spent by the first
    return torch.optim.SGD(params, lr=lr, fused=fused_kernel_takes(torch.optim.SGD, params))


def make_task(config: TrainConfig) -> Task:
    from ddp_amp.tasks import Task

    opts = read_options(config.task_options())
    words = tokenize(corpus_text())
    if opts["tokens"]:
        words = words[: int(opts["tokens"])]
    split = int(len(words) * (1 - HELD_OUT))
    vocab = build_vocab(words[:split], int(opts["vocab"]))
    ids = torch.tensor([vocab.get(word, 0) for word in words], dtype=torch.long)
    bptt = int(opts["bptt"])
    train_data, eval_data = ChunkDataset(ids[:split], bptt), ChunkDataset(ids[split:], bptt)
    if len(eval_data) == 0:
        raise UsageError("--task-opt tokens", int(opts["tokens"]), f"enough words for a held-out chunk of bptt={bptt}",
                         "raise tokens (0 = the whole corpus) or lower bptt")

    def build_model() -> TransformerLM:
        # Called with torch seeded by --seed (nothing above draws from it), as the model was
        # when built here; under --shard each rank builds only its shards.
        return TransformerLM(len(vocab), int(opts["emsize"]), int(opts["nhead"]), int(opts["nhid"]),
                             int(opts["nlayers"]), opts["dropout"])

    # The example decays the LR once per epoch; the trainer steps the scheduler once per
    # optimizer step taken, so one epoch is this many steps.
    steps_per_epoch = max(1, len(train_data) // config.batch_size)
    return Task(
        shard_units=(nn.TransformerEncoderLayer,),
        tensor_parallel_plan=TENSOR_PARALLEL_PLAN,
        build_model=build_model,
        train_data=train_data,
        eval_data=eval_data,
        loss_fn=lm_loss,
        metric=lm_metric,
        finalize_metrics=perplexity,
        make_optimizer=make_sgd,
        make_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, steps_per_epoch, gamma=0.95),
        default_lr=5.0,
        default_clip_grad_norm=0.5,
        tokens_per_sample=bptt,
        name="lm",
    )
