"""An example of a Hugging Face model as your task: a small Llama-style causal LM.

This shows how a task of your own builds a transformers model; it is not a fine-tuning
recipe. Its data is word ids of the Python docs, not the model's own tokens: to train a
pretrained model on your text, use the built-in `--task causal_lm` (docs/data.md).

Run it from the repository root (the folder that holds `examples/`), after
`pip install 'ddp_amp[hf]'` (which brings `transformers`):

    python -m ddp_amp.train --task examples.hf_causal_lm:make_task --eval-every 50
    torchrun --standalone --nproc_per_node=2 -m ddp_amp.train \\
        --task examples.hf_causal_lm:make_task --eval-every 50 --device cpu

The model is `transformers.LlamaForCausalLM` built from a small `LlamaConfig`: random
weights, nothing downloaded, no Hugging Face tokenizer. The text and its word-level
vocabulary are the built-in `lm` task's (the Python reference docs that ship with Python),
with the last 10% of the word stream held out.

The Task gives no loss_fn and no step_fn: each item is a dict
`{"input_ids": ..., "labels": ...}`, the trainer calls `model(**batch)` under its autocast
and trains on the output's `.loss`, the loss the model computes itself (it shifts the
labels by one position). The held-out metric is perplexity.

Task options (`--task-opt KEY=VALUE`): width, layers, heads, seq (positions predicted per
item), vocab (keep the N most frequent words), tokens (use only the first N words, 0 = all),
model (a Hugging Face model directory or hub name: its architecture and config instead of the
small Llama; width, layers and heads are then the model's).

`--task-opt model=DIR --init-weights DIR` builds the model from DIR's config (under --shard
each rank builds only its shards: `build_model`), then loads DIR's weights, each rank reading
only the slices it holds; `python -m ddp_amp.export RUN --to OUT --hf` hands back a directory
`from_pretrained` loads. With its word ids, that is a test of the machinery, not a recipe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_amp import Task, TrainConfig, UsageError
from ddp_amp.tasks import parse_task_options
from ddp_amp.tasks.lm import build_vocab, corpus_text, perplexity, tokenize

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PretrainedConfig

SPEC = "examples.hf_causal_lm:make_task"
# Small enough that the CLI's default 200 steps take under half a minute in fp32 on one CPU
# core (bf16/fp16 autocast is several times slower on CPUs without low-precision units).
DEFAULTS: dict[str, int | str] = {"width": 64, "layers": 2, "heads": 2, "seq": 32, "vocab": 1000, "tokens": 0,
                                  "model": ""}
HELD_OUT = 0.1


class CausalLMWindows(Dataset):
    """Item i: `seq + 1` ids starting at i * seq, as `input_ids` and as `labels`.

    The model predicts position t + 1 from positions <= t and has nothing to predict for
    the first id, so windows overlap by one id: every id after the stream's first is a
    target exactly once.
    """

    def __init__(self, ids: torch.Tensor, seq: int) -> None:
        self.ids, self.seq = ids, seq
        self.count = (len(ids) - 1) // seq

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.ids[index * self.seq:index * self.seq + self.seq + 1]
        # The same tensor twice: transformers shifts the labels itself.
        return {"input_ids": window, "labels": window}


def sum_nll(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """eval_fn: summed next-word NLL over the batch, and how many words it covers.

    Recomputed from the logits rather than taken from `.loss`: `.loss` is a mean, and the
    trainer needs a sum to weigh batches and ranks exactly.
    """
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    nll = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    return {"nll": (nll, targets.numel())}


def read_options(config: TrainConfig) -> dict[str, Any]:
    values: dict[str, Any] = dict(parse_task_options(config.task_options(), DEFAULTS))
    for key, value in values.items():
        if key == "model":
            continue
        low = 0 if key == "tokens" else 2 if key == "vocab" else 1
        if value < low:
            raise UsageError(f"--task-opt {key}", value, f"an integer >= {low}",
                             f"e.g. --task-opt {key}={DEFAULTS[key]}")
    if values["width"] % values["heads"] or (values["width"] // values["heads"]) % 2:
        raise UsageError("--task-opt heads", values["heads"], f"a divisor of width={values['width']} "
                         "that leaves an even head size", "rotary embeddings rotate pairs of channels")
    return values


def build_small_llama(vocab_size: int, opts: dict[str, Any]) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=opts["width"], intermediate_size=4 * opts["width"],
        num_hidden_layers=opts["layers"], num_attention_heads=opts["heads"],
        max_position_embeddings=opts["seq"] + 1,
        # Input and output embeddings shared: at this width they would be most of the model.
        tie_word_embeddings=True,
        # PyTorch's fused attention: trains under bf16 and fp16 autocast on a CPU as on a GPU.
        attn_implementation="sdpa",
        # No generation here: a key/value cache would only cost memory in evaluation.
        use_cache=False,
        # Our vocabulary has no such tokens; Llama's defaults (1, 2) would name real words.
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def pretrained_config(name: str) -> PretrainedConfig:
    """The config of `--task-opt model=NAME_OR_DIR` (a Hugging Face model directory, or a hub
    name where the hub is reachable), for the training context `seq` asks for."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise UsageError("--task-opt model", name, "a Hugging Face model directory (its config.json) or hub name",
                         f"{type(error).__name__}: {str(error).splitlines()[0][:160]}") from None
    config.use_cache = False  # no generation here: a key/value cache would only cost memory
    return config


def word_ids(words: list[str], split: int, vocab_size: int) -> tuple[torch.Tensor, int]:
    """The word stream as ids of the training part's most frequent words (0 is <unk>)."""
    vocab = build_vocab(words[:split], vocab_size)  # held-out words never enter the vocabulary
    return torch.tensor([vocab.get(word, 0) for word in words], dtype=torch.long), len(vocab)


def make_task(config: TrainConfig) -> Task:
    """Called once per rank; the model is built by `build_model`, which the trainer calls with
    torch seeded by --seed (under --shard each rank builds only its shards of it)."""
    opts = read_options(config)
    # First, so that a missing package is reported before any work, with how to install it.
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("--task", SPEC, "the transformers package installed", "pip install 'ddp_amp[hf]'") from None
    words = tokenize(corpus_text())
    if opts["tokens"]:
        words = words[:opts["tokens"]]
    split = int(len(words) * (1 - HELD_OUT))
    seq = opts["seq"]
    if opts["model"]:
        model_config = pretrained_config(opts["model"])
        # The word-level vocabulary, as many of its words as the model has ids for (a
        # pretrained tokenizer's ids would carry its own meaning: this is a fine-tuning
        # recipe's shape, on the corpus that ships with Python).
        ids, vocab_size = word_ids(words, split, min(opts["vocab"], model_config.vocab_size))

        def build_model() -> nn.Module:
            from transformers import AutoModelForCausalLM
            return AutoModelForCausalLM.from_config(model_config)
    else:
        ids, vocab_size = word_ids(words, split, opts["vocab"])

        def build_model() -> nn.Module:
            return build_small_llama(vocab_size, opts)
    train_data, eval_data = CausalLMWindows(ids[:split], seq), CausalLMWindows(ids[split:], seq)
    if len(eval_data) == 0:
        raise UsageError("--task-opt tokens", opts["tokens"], f"enough words for a held-out window of seq={seq}",
                         "raise tokens (0 = the whole corpus) or lower seq")
    return Task(
        build_model=build_model,
        train_data=train_data,
        eval_data=eval_data,
        eval_fn=sum_nll,
        finalize_metrics=perplexity,
        # Decayed to 0 by the last step: the final weights, the ones compared across
        # precisions, are then not caught mid-jump at a high learning rate.
        make_scheduler=lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=config.max_steps),
        default_lr=3e-3,  # AdamW (the trainer's default optimizer), unless --lr is given
        tokens_per_sample=seq,
        # --shard: each decoder layer is a unit (its parameters gathered just for it), the
        # embeddings, final norm and tied head are in the root's. Found as the children of the
        # model's largest ModuleList, whatever the architecture of a pretrained model.
        shard_units=None,
        name="hf_causal_lm",
    )


def make_task_scored_by_its_loss(config: TrainConfig) -> Task:
    """The same task without an eval_fn: its held-out data is scored by the model's own
    `.loss`, reported as eval_loss (a mean over windows), as Hugging Face's Trainer does."""
    task = make_task(config)
    task.eval_fn, task.finalize_metrics, task.name = None, None, "hf_causal_lm_loss"
    return task
