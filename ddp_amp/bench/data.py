"""The text data path's cost: tokenizing, the loader beside the step, and memory at 1e9 windows.

    python -m ddp_amp.bench --sections data --check

- tokenize: documents per second and tokens per second per core of ddp_amp's cache build
  (read JSON lines, tokenize, write the cache) against `datasets`' `load_dataset("json")` +
  `map(tokenizer, batched=True)` with the same fast tokenizer (a byte-level BPE of 8,192 ids
  trained on Python's reference docs, repeated into a corpus of about 6 MB). Each contender
  runs in a fresh process on one thread (TOKENIZERS_PARALLELISM=false, no cache reuse), in
  turn, three times (--data-trials); the medians are compared. Target: ddp_amp at least
  level (ratio >= 1).
- loader: the time to draw one micro-batch of the `causal_lm` task's windows (kept
  boundaries, the costlier path, where torch masks each document: 2.6 on) against the time
  of one whole training step of the same Trainer (a small Llama, fp32), both measured in the
  same process. Target: at most 2% of a
  step, with no loader worker (a worker would hide it entirely).
- memory: peak RSS growth and start-up time of a rank that opens a cache entry, builds its
  stream and draws 20 micro-batches, with 1e3 and with 1e9 windows (sparse token files: the
  sizes of a real entry, no tokens on disk). Target: the 1e9 rank grows at most 32 MiB more
  than the 1e3 one (a permutation of 1e9 indices alone would be 8 GB).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import AT_LEAST, target_fields
from ddp_amp.torch_api import DOCUMENT_MASKS

VOCAB = 8192
COPIES = 8  # copies of the reference docs in the tokenizing corpus: about 6 MB
TRIALS = 3
WINDOWS = (1_000, 1_000_000_000)


def sparse_entry(folder: Path, windows: int, seq: int) -> Path:
    """A cache entry of `windows` windows of zero tokens in one document, as sparse files: the
    sizes and layout of a real entry, no tokens on disk."""
    folder.mkdir(parents=True)
    tokens = windows * (seq + 1)
    meta = {"format": 1, "dtype": "uint16", "kind": "text", "masked": False, "units": [],
            "splits": {"train": {"documents": 1, "tokens": tokens, "max_id": 0}}}
    (folder / "meta.json").write_text(json.dumps(meta))
    with (folder / "train.tokens").open("wb") as handle:
        handle.truncate(tokens * 2)
    np.array([0, tokens], dtype=np.uint64).tofile(folder / "train.offsets")
    np.zeros(1, dtype=np.uint64).tofile(folder / "train.rows")
    return folder


_MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    import torch
    from ddp_amp.data import BatchStream
    from ddp_amp.data.token_store import TokenSplit
    from ddp_amp.data.windows import WrappedWindows
    folder, seq = Path(sys.argv[1]), int(sys.argv[2])
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    windows = WrappedWindows(TokenSplit(folder, "train"), seq, boundaries=True, pad_id=0)
    stream = BatchStream(windows, 16, 1, 4, seed=0, device=torch.device("cpu"), samples_per_step=64)
    for _ in range(20):
        batch = next(stream)
    print(json.dumps({"windows": len(windows), "grown_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      - baseline, "shape": list(batch["input_ids"].shape), "seconds": time.perf_counter() - started}))
""")


def memory_probe(entry: Path, seq: int) -> dict[str, Any]:
    """A fresh process's growth (KiB) and time to open `entry` and draw 20 micro-batches."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(entry), str(seq)], capture_output=True,
                         text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


_TOKENIZE = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    contender, corpus, model, scratch = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    import datasets
    from transformers import AutoTokenizer
    from ddp_amp.data.encoding import TextFormat
    from ddp_amp.data.sources import resolve_source
    from ddp_amp.data.token_cache import open_or_build
    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(model)
    started = time.perf_counter()  # after the imports: each contender's own work only
    if contender == "ddp_amp":
        split, _ = open_or_build(resolve_source(corpus, "--data"), tokenizer, model, TextFormat(), 0.0, scratch)
        documents, tokens = split.documents, split.tokens
    else:
        rows = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=str(scratch))
        done = rows.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])
        documents, tokens = len(done), sum(len(ids) for ids in done["input_ids"])
    print(json.dumps({"seconds": time.perf_counter() - started, "documents": documents, "tokens": tokens}))
""")


def _tokenizer_dir(folder: Path) -> Path:
    """A fast byte-level BPE tokenizer of VOCAB ids, trained on the reference docs, saved."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(list(topics.values()), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


def _tokenize_rows(folder: Path, copies: int, trials: int) -> list[dict[str, Any]]:
    from pydoc_data.topics import topics
    corpus = folder / "corpus.jsonl"
    documents = [topics[key] for key in sorted(topics)] * copies
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    model = _tokenizer_dir(folder / "tokenizer")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
    runs: dict[str, list[dict[str, Any]]] = {"ddp_amp": [], "datasets.map": []}
    for repeat in range(trials):
        for contender in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                out = subprocess.run([sys.executable, "-c", _TOKENIZE, contender, str(corpus), str(model), scratch],
                                     capture_output=True, text=True, check=True, env=env)
            runs[contender].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for contender, results in runs.items():
        seconds = statistics.median(result["seconds"] for result in results)
        rows.append({"contender": contender, "seconds": seconds, "documents": results[0]["documents"],
                     "tokens": results[0]["tokens"], "tokens_per_s": results[0]["tokens"] / seconds,
                     "documents_per_s": results[0]["documents"] / seconds})
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    rows[0].update(target_fields("ddp_amp / datasets.map, tokens per second per core", ratio, 1.0, AT_LEAST))
    return rows


def _loader_row(folder: Path) -> dict[str, Any]:
    """Draw time of one micro-batch against one training step of the causal_lm Trainer."""
    import torch

    from ddp_amp.config import TrainConfig
    from ddp_amp.session import Session
    from ddp_amp.trainer import build_trainer

    from pydoc_data.topics import topics
    from transformers import LlamaConfig, LlamaForCausalLM

    model = _tokenizer_dir(folder / "model")
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, max_position_embeddings=512)).save_pretrained(model)
    corpus = folder / "loader.jsonl"
    corpus.write_text("".join(json.dumps({"text": topics[key]}) + "\n" for key in sorted(topics)))
    # Kept boundaries where this torch masks each document (else the task refuses them).
    boundaries = str(DOCUMENT_MASKS.available()).lower()
    config = TrainConfig(task="causal_lm", task_opt=(f"model={model}", "max_length=256", f"boundaries={boundaries}"),
                         data=(str(corpus),), data_cache=str(folder / "cache"), batch_size=8, device="cpu",
                         precision="fp32", max_steps=100, eval_every=0)
    with Session("fp32", "cpu") as session:
        trainer = build_trainer(session, config)
        trainer.train_step()  # the first step pays one-time costs
        steps, draws = [], []
        for _ in range(10):
            started = time.perf_counter()
            trainer.train_step()
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            next(trainer.stream)
            draws.append(time.perf_counter() - started)
    step, draw = statistics.median(steps), statistics.median(draws)
    return {"step_s": step, "draw_s": draw, "batch": 8, "seq": 256, "boundaries": boundaries == "true",
            **target_fields("micro-batch draw / training step", draw / step, 0.02), "threads": torch.get_num_threads()}


def _memory_rows(folder: Path) -> list[dict[str, Any]]:
    rows = [{"windows": windows, **memory_probe(sparse_entry(folder / str(windows), windows, 7), 7)}
            for windows in WINDOWS]
    grown = (rows[1]["grown_kib"] - rows[0]["grown_kib"]) / 1024
    rows[1].update(target_fields("peak RSS growth at 1e9 windows - at 1e3, MiB", grown, 32.0))
    return rows


def run(copies: int = COPIES, trials: int = TRIALS) -> dict[str, Any]:
    """The three measurements; a part that cannot run here says why instead."""
    section: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        section["memory"] = {"rows": _memory_rows(folder)}
        try:
            import datasets  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            section["missing"] = "pip install 'ddp_amp[text]' for the tokenize and loader parts"
            return section
        section["tokenize"] = {"rows": _tokenize_rows(folder, copies, trials)}
        section["loader"] = _loader_row(folder)
    return section


def data_table(section: dict[str, Any]) -> str:
    """The section as three small tables."""
    parts = []
    if "tokenize" in section:
        lines = [[row["contender"], f"{row['documents']:,}", f"{row['tokens']:,}", f"{row['seconds']:.2f}",
                  f"{row['documents_per_s']:,.0f}", f"{row['tokens_per_s']:,.0f}"]
                 for row in section["tokenize"]["rows"]]
        parts.append("data: tokenizing JSON lines on one core (median of fresh processes, in turn)\n" + grid(
            ["contender", "documents", "tokens", "seconds", "docs/s", "tokens/s"], lines))
    if "loader" in section:
        row = section["loader"]
        parts.append("data: causal_lm loader against its step (no worker)\n" + grid(
            ["step ms", "draw ms", "draw / step"], [[f"{row['step_s'] * 1e3:.1f}", f"{row['draw_s'] * 1e3:.3f}",
                                                     f"{row['measured']:.4f}"]]))
    lines = [[f"{row['windows']:,}", f"{row['grown_kib'] / 1024:.1f}", f"{row['seconds']:.3f}"]
             for row in section["memory"]["rows"]]
    parts.append("data: a rank opening a cache entry and drawing 20 micro-batches\n" + grid(
        ["windows", "peak RSS growth MiB", "seconds"], lines))
    if "missing" in section:
        parts.append(section["missing"])
    return "\n\n".join(parts)
