"""A Hugging Face model directory made offline, for the text tests: a byte-level BPE tokenizer
trained with `tokenizers` on the Python reference docs (pydoc_data, part of the standard
library), a chat template, and a small Llama, all written with save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# A ChatML-like template: each turn is <|role|>content</s>, and the generation prompt is the
# assistant header. TRAINING_TEMPLATE marks the assistant's part for transformers' own
# assistant mask (what TRL's assistant_only_loss reads) around the same characters.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TRAINING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
                     "{{ m['content'] }}</s>{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
                     "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def corpus_documents(count: int | None = None) -> list[str]:
    """Documents of real English text: the Python reference's topics, in a fixed order."""
    from pydoc_data.topics import topics
    documents = [topics[key] for key in sorted(topics)]
    return documents[:count] if count else documents


def train_tokenizer(vocab_size: int = 512, bos: bool = True) -> Any:
    """A byte-level BPE tokenizer (transformers' fast tokenizer) trained on the corpus; with
    `bos`, it starts every encoding with <s> as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_documents(), trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model_dir(folder: Path, vocab_size: int = 512, width: int = 64, layers: int = 2, heads: int = 2,
                   max_positions: int = 256, seed: int = 0, tokenizer: Any = None) -> Path:
    """A model directory: config.json, model.safetensors and the tokenizer's files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer if tokenizer is not None else train_tokenizer(vocab_size)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, use_cache=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def split_corpus(folder: Path) -> dict[str, Path]:
    """What the tensor- and context-parallel tests train on: a tiny Llama's directory (width 32,
    2 layers, 2 heads, 256 tokens), 60 documents of text and 60 conversations, a data cache."""
    return {"model": make_model_dir(folder / "model", vocab_size=256, width=32, layers=2, heads=2, max_positions=128),
            "text": write_jsonl(folder / "text.jsonl", [{"text": d} for d in corpus_documents(60)]),
            "chat": write_jsonl(folder / "chat.jsonl", conversations(60)), "cache": folder / "cache"}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def conversations(count: int) -> list[dict[str, Any]]:
    """Conversations of several turns built from the corpus's sentences."""
    sentences = [s.strip() for doc in corpus_documents(200) for s in doc.split(".") if 20 < len(s.strip()) < 200]
    rows = []
    for i in range(count):
        picked = [sentences[(7 * i + k) % len(sentences)] for k in range(4)]
        messages = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": picked[0]}, {"role": "assistant", "content": picked[1]},
                     {"role": "user", "content": picked[2]}, {"role": "assistant", "content": picked[3]}]
        rows.append({"messages": messages[: len(messages) - 2 * (i % 2)]})
    return rows
