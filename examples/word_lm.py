"""PyTorch's word-level LSTM language model ("word_language_model") as a `--task` plugin.

Run it from the repository root (the folder that holds `examples/`):

    python -m ddp_amp.train --task examples.word_lm:make_task --batch-size 20 \\
        --keep-best eval_nll --eval-every 200
    torchrun --standalone --nproc_per_node=2 -m ddp_amp.train --task examples.word_lm:make_task \\
        --batch-size 20 --keep-best eval_nll --eval-every 200 --device cpu

What the original script does, and where it is here:
- `batchify`: the text is cut into S parallel streams, S = the global micro-batch
  (`--batch-size / --grad-accum`); `ChunkGrid` numbers the chunks of `bptt` words so that
  every rank's rows continue their own streams from step to step (with `--num-workers` 0
  or 1: several workers would take turns at a rank's batches).
- truncated BPTT: the LSTM starts each chunk from the hidden state the last chunk left,
  detached (`CarriedHidden`, the Task's `state`: checkpointed per rank, resumed exactly),
  and from zeros where a stream starts over (the first chunk of each pass).
- SGD at lr 20, gradients clipped at 0.25; the LR divided by 4 whenever the validation loss
  does not improve (`ReduceLROnPlateau(factor=0.25, patience=0)` after each evaluation);
  `--keep-best eval_nll` keeps the best checkpoint, and the test split is scored with it.

The corpus is the built-in `lm` task's (the Python reference docs that ship with Python,
no download), split 80/10/10 into train, validation and test. Held-out text is laid out as
the training text (S streams, the hidden state carried from chunk to chunk within one
evaluation), where the original uses 10 streams. The last, shorter chunk of a stream, which
the original keeps, is dropped: a batch's rows must be one length.

Task options (`--task-opt KEY=VALUE`): emsize, nhid, nlayers, bptt, vocab (keep the N most
frequent words, 0 = all), tokens (use only the first N words, 0 = all), dropout (a float).
`examples/word_lm_session.py` trains the same model on the same data with a hand-written
loop on `ddp_amp.Session`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ddp_amp import Task, TrainConfig, UsageError
from ddp_amp.tasks import parse_task_options
from ddp_amp.tasks.lm import build_vocab, corpus_text, perplexity, tokenize

# The original script's defaults (its --emsize, --nhid, --nlayers, --bptt, --dropout).
DEFAULTS: dict[str, float] = {"emsize": 200, "nhid": 200, "nlayers": 2, "bptt": 35,
                              "vocab": 0, "tokens": 0, "dropout": 0.2}
DEFAULT_LR, DEFAULT_CLIP = 20.0, 0.25
TRAIN_SHARE, VALID_SHARE = 0.8, 0.1  # the rest of the word stream is the test split
PLATEAU_FACTOR = 0.25  # the original's `lr /= 4.0` when the validation loss did not improve
Batch = dict[str, torch.Tensor]  # "tokens", "targets": (rows, bptt); "chunk": (rows,)


def read_options(options: dict[str, str]) -> dict[str, float]:
    """`--task-opt` pairs over DEFAULTS, range-checked."""
    values = parse_task_options(options, DEFAULTS)
    for key, value in values.items():
        low = 0 if key in ("vocab", "tokens", "dropout") else 1
        if value < low or (key == "dropout" and value >= 1):
            raise UsageError(f"--task-opt {key}", options.get(key, value),
                             f"a number >= {low}" + (" and < 1" if key == "dropout" else ""),
                             f"e.g. --task-opt {key}={DEFAULTS[key]:g}")
    return values


# --- data: parallel text streams, cut into chunks of bptt words ---------------------------

class ChunkGrid(Dataset):
    """The text as `streams` parallel streams (the original's `batchify`), in chunks of `bptt`.

    Item k is chunk k // streams of stream k % streams: {"tokens", "targets" (the same words
    shifted by one), "chunk" (its index in the stream)}. Read in order and dealt out round
    robin over N ranks, rank r's i-th micro-batch of m = streams / N rows holds items
    r + N * (i * m + j), j < m: chunk i of streams r, r + N, r + 2N, ... So every row continues
    its own stream from one micro-batch to the next, on any number of ranks that divides
    `streams`, and one rank with S rows reads the same chunks as two ranks with S / 2 each.
    The trainer deals out a stream (training) and scores held-out data (evaluation) exactly so.
    """

    def __init__(self, ids: torch.Tensor, streams: int, bptt: int) -> None:
        per_stream = len(ids) // streams
        self.rows = ids[: per_stream * streams].view(streams, per_stream)  # row s: stream s
        self.streams, self.bptt = streams, bptt
        self.chunks = max(0, (per_stream - 1) // bptt)  # whole chunks only: a batch's rows are one length

    def __len__(self) -> int:
        return self.chunks * self.streams

    def __getitem__(self, index: int) -> Batch:
        chunk, stream = divmod(index, self.streams)
        start = chunk * self.bptt
        words = self.rows[stream, start:start + self.bptt + 1]
        return {"tokens": words[:-1], "targets": words[1:], "chunk": torch.tensor(chunk)}


class ChunkStream(IterableDataset):
    """A `ChunkGrid` read in order, as a stream: the trainer deals item k to rank k mod N.

    A stream rather than the grid itself, because map-style training data is shuffled, and a
    carried hidden state needs each row's chunks in reading order.
    """

    def __init__(self, grid: ChunkGrid) -> None:
        self.grid = grid

    def __iter__(self) -> Iterator[Batch]:
        return (self.grid[index] for index in range(len(self.grid)))


@dataclass
class Corpus:
    train: ChunkGrid
    valid: ChunkGrid
    test: ChunkGrid
    vocab_size: int


def load_corpus(options: dict[str, float], streams: int) -> Corpus:
    """The `lm` task's text, tokenized, split 80/10/10, each split in `streams` streams."""
    words = tokenize(corpus_text())
    if options["tokens"]:
        words = words[: int(options["tokens"])]
    train_end = int(len(words) * TRAIN_SHARE)
    valid_end = int(len(words) * (TRAIN_SHARE + VALID_SHARE))
    vocab = build_vocab(words[:train_end], int(options["vocab"]))  # from the training split only
    ids = torch.tensor([vocab.get(word, 0) for word in words], dtype=torch.long)  # 0: <unk>
    bptt = int(options["bptt"])
    splits = [ChunkGrid(part, streams, bptt) for part in (ids[:train_end], ids[train_end:valid_end], ids[valid_end:])]
    for name, grid in zip(("training", "validation", "test"), splits):
        if len(grid) == 0:
            raise UsageError("--task-opt tokens", int(options["tokens"]),
                             f"enough words for one chunk of bptt={bptt} in each of {streams} {name} streams",
                             "raise tokens (0 = the whole corpus), or lower bptt or --batch-size")
    return Corpus(*splits, vocab_size=len(vocab))


def stream_count(config: TrainConfig) -> int:
    """Text streams S: one per row of the global micro-batch, so each rank's rows are its own."""
    return config.batch_size // config.grad_accum


# --- model and the carried state ----------------------------------------------------------

class WordLSTM(nn.Module):
    """Embedding -> dropout -> LSTM -> dropout -> Linear to the vocabulary (the original's RNNModel)."""

    def __init__(self, ntoken: int, emsize: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, emsize)
        self.rnn = nn.LSTM(emsize, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        for weight in (self.encoder.weight, self.decoder.weight):
            nn.init.uniform_(weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """tokens (rows, bptt), hidden (h, c) or None for zeros -> logits (rows, bptt, ntoken), (h, c)."""
        embedded = self.drop(self.encoder(tokens))
        if embedded.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Under CPU autocast (bf16, fp16) oneDNN fails to build its LSTM for an fp32 input
            # ("could not create a primitive descriptor"); an input in the autocast dtype works.
            embedded = embedded.to(torch.get_autocast_dtype("cpu"))
        output, hidden = self.rnn(embedded, hidden)
        return self.decoder(self.drop(output)), hidden


def build_model(options: dict[str, float], vocab_size: int) -> WordLSTM:
    return WordLSTM(vocab_size, int(options["emsize"]), int(options["nhid"]), int(options["nlayers"]),
                    options["dropout"])


class CarriedHidden:
    """The LSTM's (h, c) between chunks on this rank: the Task's `state`, so checkpointed per rank."""

    def __init__(self) -> None:
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None

    def start_for(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The state to start these rows from: the last chunk's, but zeros in rows whose stream
        starts over (chunk 0, a new pass). Selected on the device: no host read per step, and
        `where` (not a multiply by 0) also clears a state that went inf or NaN."""
        if self.value is None:
            return None
        starts_over = (chunk == 0).view(1, -1, 1)  # (layers, rows, width) broadcast
        return tuple(torch.where(starts_over, 0.0, part) for part in self.value)  # type: ignore[return-value]

    def keep(self, hidden: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep the chunk's last state, detached: gradients stop at the chunk (truncated BPTT)."""
        self.value = tuple(part.detach() for part in hidden)  # type: ignore[assignment]

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        value = state["value"]
        self.value = None if value is None else tuple(value)  # type: ignore[assignment]


def chunk_loss(model: nn.Module, batch: Batch, hidden: CarriedHidden) -> torch.Tensor:
    """Mean next-word cross-entropy of one micro-batch of chunks, carrying `hidden` on."""
    logits, last = model(batch["tokens"], hidden.start_for(batch["chunk"]))
    hidden.keep(last)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())


def chunk_nll(model: nn.Module, batch: Batch, hidden: CarriedHidden) -> tuple[torch.Tensor, int]:
    """Summed next-word NLL of held-out chunks and their word count, carrying `hidden` on."""
    logits, last = model(batch["tokens"], hidden.start_for(batch["chunk"]))
    hidden.keep(last)
    targets = batch["targets"]
    nll = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    return nll, targets.numel()


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    # Plain SGD, as the original's hand-written update. Fused: it takes the loss scaler's
    # skip flag on the device, where a plain SGD makes the scaler read it every fp16 step.
    return torch.optim.SGD(params, lr=lr, fused=True)


def make_plateau_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    # threshold 0: any strictly lower validation loss counts as better, as in the original.
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=PLATEAU_FACTOR,
                                                      patience=0, threshold=0.0)


# --- the task -----------------------------------------------------------------------------

def make_task(config: TrainConfig) -> Task:
    if config.num_workers > 1:
        # Each worker would make every W-th batch of a rank: a row would switch streams between steps.
        raise UsageError("--num-workers", config.num_workers, "0 or 1 for examples.word_lm",
                         "several workers take turns at a rank's batches, so its rows would not continue "
                         "their text streams from step to step")
    options = read_options(config.task_options())
    corpus = load_corpus(options, stream_count(config))
    hidden = CarriedHidden()  # training's, carried from step to step
    scoring = CarriedHidden()  # evaluation's: each pass starts at chunk 0, so it needs no checkpoint

    def step(model: nn.Module, batch: Batch) -> torch.Tensor:
        return chunk_loss(model, batch, hidden)

    def score(model: nn.Module, batch: Batch) -> dict[str, tuple[torch.Tensor, int]]:
        return {"nll": chunk_nll(model, batch, scoring)}

    return Task(
        model=build_model(options, corpus.vocab_size),  # the trainer seeds before calling us
        train_data=ChunkStream(corpus.train),
        step_fn=step,
        state=hidden,
        eval_data=corpus.valid,
        eval_fn=score,
        finalize_metrics=perplexity,  # eval_ppl = exp(eval_nll)
        test_data=corpus.test,
        make_optimizer=make_optimizer,
        make_scheduler=make_plateau_schedule,
        schedule_on="eval:eval_nll",
        default_lr=DEFAULT_LR,
        default_clip_grad_norm=DEFAULT_CLIP,
        tokens_per_sample=int(options["bptt"]),
        name="word_lm",
    )

