"""Text sources to training and held-out windows: the data side of the `causal_lm` task.

`text_datasets` (collective) resolves every `--data` / `--eval-data` source, tokenizes each
into the cache once (token_cache.py), cuts windows (windows.py: wrapped like group_texts, or
whole documents packed best-fit decreasing), checks every token id against the model's
vocabulary, and mixes the sources by weight (mixture.py). Held-out windows come from
`--eval-data`, else from the documents `test_size` holds out of the training sources.
Everything a rank keeps is memory-mapped: its memory does not grow with the data.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ddp_amp.data.encoding import TextFormat
from ddp_amp.data.mixture import Mixture
from ddp_amp.data.packing import PackPlan, PackStats, build_plan, kept_spans
from ddp_amp.data.plan_store import Plan, planned
from ddp_amp.data.readers import Unit, where
from ddp_amp.data.sources import resolve_source
from ddp_amp.data.token_cache import open_or_build
from ddp_amp.data.token_store import TokenSplit
from ddp_amp.data.windows import PackedWindows, WrappedWindows, trained_windows
from ddp_amp.distributed import has_peers, on_every_rank
from ddp_amp.errors import UsageError


@dataclass(frozen=True)
class WindowOptions:
    """How documents become windows."""

    seq: int  # tokens the model sees per item
    packing: str  # "wrapped", "bfd", or "" (bfd for conversations and completions, wrapped for text)
    boundaries: bool  # wrapped: keep document boundaries inside a window (bfd always does)
    truncation_mode: str  # bfd: keep_start, keep_end or drop a document longer than a window
    pad_id: int


@dataclass
class TextData:
    train: Dataset
    eval: Dataset | None
    identity: str  # a digest of the caches the windows come from: a resume compares it


def _say(line: str) -> None:
    import torch.distributed as dist
    if not has_peers() or dist.get_rank() == 0:
        print(f"[ddp_amp] data: {line}", file=sys.stderr, flush=True)


def check_vocabulary(split: TokenSplit, vocab_size: int, model: str, flag: str = "--data") -> None:
    """A one-line error naming the file and row of the first token id >= `vocab_size` (of a
    source that `flag` named)."""
    if split.max_id < vocab_size:
        return
    found = split.first_token_at_least(vocab_size)
    if found is None:
        return
    position, token = found
    document = int(split.document_starts(0, position + 1).size) - 1
    unit_index, locator = split.row_of(document)
    raise UsageError(flag, where(Unit.from_list(split.meta["units"][unit_index]), locator),
                     f"token ids below the model's vocab_size {vocab_size}",
                     f"its tokens include id {token}: the tokenizer has more ids than {model}'s embedding; use the "
                     "model's own tokenizer, or resize its embeddings")


def _held(plan: Plan) -> str:
    return f"; planned in memory, as {plan.held_because}" if plan.held_because else ""


def _windows(split: TokenSplit, options: WindowOptions) -> tuple[Dataset, str, int]:
    """The split's windows, what the start line says of them, and how many were dropped with
    no target. Wrapped text needs no plan; wrapped masked documents and packed ones are
    planned once (plan_store.py)."""
    capacity = options.seq + 1
    if (options.packing or ("bfd" if split.masked else "wrapped")) == "wrapped":
        if not split.masked:  # every window of text holds targets
            return WrappedWindows(split, options.seq, options.boundaries, options.pad_id), "", 0
        name = f"{split.split}.wrapped-{capacity}" + ("-boundaries" if options.boundaries else "")
        plan = planned(split.folder / name, lambda: trained_windows(split, options.seq, options.boundaries))
        windows = WrappedWindows(split, options.seq, options.boundaries, options.pad_id,
                                 plan.arrays if plan.facts["untrained"] else None)
        return windows, f" ({plan.facts['untrained']:,} dropped with no target in them{_held(plan)})", \
            plan.facts["untrained"]

    def make() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        starts, stops = kept_spans(split.offsets, capacity, options.truncation_mode)
        # A piece's first token is no label: a target is one of the others (and the mask's).
        trained = split.targets_in(starts + 1, stops, skip_starts=True) > 0 if split.masked else None
        arrays, stats = build_plan(split.lengths(), capacity, options.truncation_mode, trained)
        return arrays, asdict(stats)

    plan = planned(split.folder / f"{split.split}.bfd-{capacity}-{options.truncation_mode}", make)
    stats = PackStats(**plan.facts)
    note = (f", {stats.documents:,} documents packed best-fit decreasing into {stats.windows:,} windows "
            f"({stats.fill:.1%} filled; {stats.truncated:,} truncated, {stats.dropped:,} dropped as longer than "
            f"{capacity} tokens, {stats.untrained:,} dropped with no target in the part a window keeps{_held(plan)})")
    return PackedWindows(split, PackPlan(plan.arrays, capacity, options.truncation_mode), options.seq,
                         options.pad_id), note, stats.untrained


def text_datasets(train_specs: tuple[str, ...], eval_specs: tuple[str, ...], tokenizer: Any, tokenizer_dir: Path,
                  fmt: TextFormat, test_size: float, options: WindowOptions, cache_root: Path, seed: int,
                  vocab_size: int, model: str) -> TextData:
    """Training and held-out windows of the named sources (collective: every rank, in the same order)."""
    if not train_specs:
        raise UsageError("--data", "(none)", "at least one source for this task", "e.g. --data corpus/*.jsonl")
    train_parts: list[tuple[Dataset, float]] = []
    eval_parts: list[Dataset] = []
    keys: list[Any] = []
    # Every source found on every rank, agreed, before the first collective of a build.
    sources = on_every_rank(lambda: [resolve_source(spec, "--data") for spec in train_specs])
    eval_sources = on_every_rank(lambda: [resolve_source(spec, "--eval-data") for spec in eval_specs])
    for spec, source in zip(train_specs, sources):
        train, held = open_or_build(source, tokenizer, tokenizer_dir, fmt, test_size if not eval_specs else 0.0,
                                    cache_root)
        for split in (train, held):
            if split is not None:
                check_vocabulary(split, vocab_size, model, source.flag)
        windows, note, untrained = _windows(train, options)
        # Windows with no target were once kept: a checkpoint of that time trained on another list.
        keys.append([train.folder.name, source.weight, *(["untrained dropped"] if untrained else [])])
        _say(f"{spec}: {train.documents:,} documents, {train.tokens:,} tokens -> {len(windows):,} windows of "  # type: ignore[arg-type]  # map-style
             f"{options.seq + 1} tokens{note}")
        if len(windows) == 0:  # type: ignore[arg-type]  # map-style
            raise UsageError("--data", spec, f"at least one window of {options.seq + 1} tokens with a target",
                             f"it holds {train.tokens:,} tokens; lower --task-opt max_length or add data (the line "
                             "above counts what was dropped with no target: raise max_length for those)")
        train_parts.append((windows, source.weight))
        if held is not None:
            eval_parts.append(_windows(held, options)[0])
    for source in eval_sources:
        split, _ = open_or_build(source, tokenizer, tokenizer_dir, fmt, 0.0, cache_root)
        check_vocabulary(split, vocab_size, model, source.flag)
        keys.append(["eval", split.folder.name])
        eval_parts.append(_windows(split, options)[0])
    train_data: Dataset = train_parts[0][0] if len(train_parts) == 1 and train_parts[0][1] == 1 else \
        Mixture(train_parts, seed)
    eval_data = None
    if eval_parts:
        eval_data = eval_parts[0] if len(eval_parts) == 1 else Mixture([(part, 1.0) for part in eval_parts], seed)
        if len(eval_data) == 0:  # type: ignore[arg-type]  # map-style
            raise UsageError("--eval-data" if eval_specs else "--task-opt test_size", ", ".join(eval_specs) or
                             str(test_size), f"at least one held-out window of {options.seq + 1} tokens",
                             "add held-out text, or raise test_size")
    identity = hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:24]
    return TextData(train_data, eval_data, identity)
