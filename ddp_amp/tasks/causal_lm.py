"""`causal_lm`: pretrain or fine-tune a Hugging Face causal LM on your own text, through its own tokenizer.

    python -m ddp_amp.train --task causal_lm --task-opt model=DIR --init-weights DIR \\
        --data 'corpus/*.jsonl' --data chats.parquet --task-opt max_length=2048

`--task-opt model=DIR` is a model directory (`save_pretrained`'s): its config gives the
architecture, built with `build_model` (under `--shard` each rank builds only its shards), and
its tokenizer files the tokenizer (read offline). `--init-weights DIR` loads its weights.

The data (`--data`, `--eval-data`; ddp_amp/data/text_data.py): text documents, conversations
(`messages`) or prompt/completion rows, from JSON lines, JSON, parquet, text or `datasets`
folders, tokenized once into a cache every later run reuses, cut into windows of
`max_length` + 1 tokens, visited in a seeded order in which optimizer step k holds the same
windows on any number of ranks. docs/data.md says it all.

Task options (TRL's SFTConfig spellings where it has one): model, max_length (tokens per
item), packing (wrapped: documents end to end, as run_clm.py's group_texts; bfd: whole
documents packed best-fit decreasing; default wrapped for text, bfd for conversations),
boundaries (true: with wrapped packing, positions restart and no loss or attention crosses a
document boundary), truncation_mode (keep_start, keep_end or drop, for documents longer than a
bfd window), dataset_text_field, sample_by (.txt files: line, paragraph, document),
assistant_only_loss, completion_only_loss, test_size (the fraction of documents held out for
evaluation where no --eval-data is given), lr_scheduler_type (linear, cosine, constant),
warmup_steps, warmup_ratio.

The loss of an optimizer step is the mean next-token cross-entropy over every token the labels
keep in the step's windows, on every rank and micro-batch together (one sum over one count), so
any split of the same global batch trains the same update; evaluation reports `eval_loss` (per
token, over every held-out token) and `eval_ppl`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddp_amp.data.encoding import TextFormat
from ddp_amp.data.packing import TRUNCATION_MODES
from ddp_amp.data.readers import SAMPLE_BY
from ddp_amp.data.text_data import WindowOptions, text_datasets
from ddp_amp.data.windows import IGNORE
from ddp_amp.distributed import on_every_rank
from ddp_amp.errors import UsageError
from ddp_amp.hf import build_causal_lm, load_tokenizer, model_config, require_transformers, tokenizer_files
from ddp_amp.tasks import parse_task_options
from ddp_amp.torch_api import DOCUMENT_MASKS

if TYPE_CHECKING:
    from ddp_amp.config import TrainConfig
    from ddp_amp.tasks import Task

DEFAULTS: dict[str, int | float | str] = {
    "model": "", "max_length": 1024, "packing": "", "boundaries": "false", "truncation_mode": "keep_start",
    "dataset_text_field": "text", "sample_by": "line", "assistant_only_loss": "true",
    "completion_only_loss": "true", "test_size": 0.0, "lr_scheduler_type": "linear", "warmup_steps": 0,
    "warmup_ratio": 0.0}
CHOICES = {"packing": ("", "wrapped", "bfd"), "truncation_mode": TRUNCATION_MODES, "sample_by": SAMPLE_BY,
           "lr_scheduler_type": ("linear", "cosine", "constant")}
SWITCHES = ("boundaries", "assistant_only_loss", "completion_only_loss")


def _switch(key: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise UsageError(f"--task-opt {key}", raw, "true or false", f"e.g. --task-opt {key}=true")
    return value in ("true", "1", "yes")


def read_options(config: TrainConfig) -> dict[str, Any]:
    values: dict[str, Any] = parse_task_options(config.task_options(), DEFAULTS)
    for key, choices in CHOICES.items():
        if values[key] not in choices:
            raise UsageError(f"--task-opt {key}", values[key], "one of " + ", ".join(c for c in choices if c),
                             f"e.g. --task-opt {key}={choices[1] if not choices[0] else choices[0]}")
    for key in SWITCHES:
        values[key] = _switch(key, values[key])
    if values["boundaries"]:
        DOCUMENT_MASKS.require("--task-opt boundaries", "true", otherwise="drop it (documents then attend across "
                               "their boundaries in a packed window)")
    if not values["model"]:
        raise UsageError("--task-opt model", "(none)", "a Hugging Face model directory (config.json and tokenizer)",
                         "e.g. --task-opt model=/models/Llama-3.2-1B")
    if values["max_length"] < 1:
        raise UsageError("--task-opt max_length", values["max_length"], "an integer >= 1", "e.g. max_length=2048")
    chunks = 2 * config.parallel_options().context_parallel
    if chunks > 2 and values["max_length"] % chunks:
        # A window's max_length inputs and their labels (shifted before the cut) are cut in 2N equal chunks.
        raise UsageError("--task-opt max_length", values["max_length"], f"a multiple of 2 x --context-parallel = "
                         f"{chunks} (each rank keeps 2 of {chunks} equal chunks of every window)",
                         f"e.g. --task-opt max_length={max(chunks, values['max_length'] // chunks * chunks)}")
    for key in ("test_size", "warmup_ratio"):
        if not 0 <= values[key] < 1:
            raise UsageError(f"--task-opt {key}", values[key], "a fraction in [0, 1)", f"e.g. {key}=0.01")
    if values["warmup_steps"] < 0:
        raise UsageError("--task-opt warmup_steps", values["warmup_steps"], "an integer >= 0", "e.g. warmup_steps=100")
    return values


def lr_factor(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning rate's multiplier after `step` optimizer steps, as Hugging Face's schedulers
    of that name: a linear warm-up over `warmup` steps, then linear decay to 0 at `total`, a
    cosine half-wave to 0, or constant. Computed from this launch's --max-steps, so a resume
    that raises it stretches the decay instead of restarting it."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0
    return factor


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    # Positions that restart inside a window make transformers mask attention per document.
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits


def summed_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token NLL over the labels kept, how many were kept)."""
    nll = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                                      reduction="sum")
    return nll, (labels != IGNORE).sum()


def token_nll_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """step_fn: the micro-batch's NLL summed over its kept tokens; the Trainer divides the
    step's sums by the step's kept tokens over every micro-batch and rank (`target_tokens`)."""
    return summed_nll(_logits(model, batch), batch["labels"])[0]


def target_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """count_loss_items: the tokens whose next-token loss a batch keeps."""
    return (batch["labels"] != IGNORE).sum()


def eval_nll(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """eval_fn: summed NLL and the tokens it covers; the evaluation adds them over ranks."""
    nll, kept = summed_nll(_logits(model, batch), batch["labels"])
    return {"loss": (nll, int(kept))}


def perplexity(means: dict[str, float]) -> dict[str, float]:
    return {**means, "ppl": math.exp(min(means["loss"], 700.0))}  # 700: exp() stays finite


def cache_root(config: TrainConfig) -> Path:
    """--data-cache, else $DDP_AMP_DATA_CACHE, else ~/.cache/ddp_amp/data."""
    chosen = config.data_cache or os.environ.get("DDP_AMP_DATA_CACHE") or "~/.cache/ddp_amp/data"
    return Path(chosen).expanduser()


def make_task(config: TrainConfig) -> Task:
    """Collective (the data is tokenized by every rank together): called on every rank."""
    from ddp_amp.tasks import Task

    opts = read_options(config)
    require_transformers("--task", "causal_lm")
    directory, seq = opts["model"], opts["max_length"]
    # On every rank, agreed before the data's collectives: a rank that cannot read the model
    # directory fails together with the others instead of leaving them in a collective.
    architecture, tokenizer = on_every_rank(lambda: (model_config(directory, seq), load_tokenizer(directory)))
    fmt = TextFormat(opts["dataset_text_field"], opts["sample_by"], opts["assistant_only_loss"],
                     opts["completion_only_loss"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    windows = WindowOptions(seq, opts["packing"], opts["boundaries"], opts["truncation_mode"], pad)
    data = text_datasets(config.data, config.eval_data, tokenizer, Path(directory), fmt, opts["test_size"], windows,
                         cache_root(config), config.seed, architecture.vocab_size, directory)

    def build_model() -> nn.Module:
        return build_causal_lm(architecture)

    return Task(
        build_model=build_model,
        train_data=data.train,
        eval_data=data.eval,
        step_fn=token_nll_sum,
        count_loss_items=target_tokens,
        eval_fn=eval_nll if data.eval is not None else None,
        finalize_metrics=perplexity if data.eval is not None else None,
        make_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(
            opts["lr_scheduler_type"], opts["warmup_steps"] or math.ceil(opts["warmup_ratio"] * config.max_steps),
            config.max_steps)),
        default_lr=2e-5,  # TRL's SFT default for AdamW, unless --lr is given
        tokens_per_sample=seq,
        data_identity=data.identity,
        hf_files=tuple(str(path) for path in tokenizer_files(Path(directory))),
        name="causal_lm",
    )
