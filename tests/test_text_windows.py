"""Windows cut from tokenized text (ddp_amp/data/windows.py, packing.py): wrapped windows are
run_clm.py's group_texts token for token; with boundaries kept, each document inside a packed
window gets the logits it gets alone; best-fit decreasing keeps documents whole."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddp_amp.data import BatchStream
from ddp_amp.data.encoding import TextFormat
from ddp_amp.data.packing import PackPlan, build_plan
from ddp_amp.data.plan_store import PlanArrays
from ddp_amp.data.sources import resolve_source
from ddp_amp.data.token_cache import open_or_build
from ddp_amp.data.text_data import WindowOptions, text_datasets
from ddp_amp.data.token_store import TokenSplit
from ddp_amp.data.windows import IGNORE, PackedWindows, WrappedWindows
from ddp_amp.torch_api import DOCUMENT_MASKS
from tests.multiproc import REPO_ROOT, cli_env
from tests.text_model import conversations, corpus_documents, make_model_dir, write_jsonl
from tests.torch_features import needs

SEQ = 63


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"), vocab_size=400, width=32, layers=2, heads=2,
                          max_positions=128)


def _split(tmp: Path, model_dir: Path, texts: list[str]) -> TokenSplit:
    from transformers import AutoTokenizer
    write_jsonl(tmp / "docs.jsonl", [{"text": text} for text in texts])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = open_or_build(resolve_source(str(tmp / "docs.jsonl"), "--data"), tokenizer, model_dir, TextFormat(),
                             0.0, tmp / "cache")
    return train


def _group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """run_clm.py's group_texts, as its documentation states it: join every column's lists
    end to end, drop what does not fill a last block, cut into blocks; labels are a copy."""
    joined = {name: list(chain.from_iterable(lists)) for name, lists in examples.items()}
    usable = len(joined["input_ids"]) // block_size * block_size
    blocks = {name: [values[i:i + block_size] for i in range(0, usable, block_size)] for name, values in joined.items()}
    blocks["labels"] = [list(block) for block in blocks["input_ids"]]
    return blocks


def test_wrapped_windows_are_group_texts_token_for_token(tmp_path: Path, model_dir: Path) -> None:
    import datasets
    from transformers import AutoTokenizer

    texts = corpus_documents(40)  # one datasets.map batch (1000 rows): group_texts drops one remainder
    windows = WrappedWindows(_split(tmp_path, model_dir, texts), SEQ, boundaries=False, pad_id=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # run_clm.py's way, with the EOS TRL appends to each text (as ddp_amp joins documents):
    raw = datasets.Dataset.from_dict({"text": [text + tokenizer.eos_token for text in texts]})
    tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])
    grouped = tokenized.map(lambda batch: _group_texts(batch, SEQ + 1), batched=True)
    assert len(windows) == len(grouped) > 50
    for index in range(len(windows)):
        item = windows[index]
        assert item["input_ids"].tolist() + item["labels"][-1:].tolist() == grouped[index]["input_ids"]
        assert item["labels"].tolist() == grouped[index]["labels"][1:]  # the shift the model does, done here


@needs(DOCUMENT_MASKS)
def test_kept_boundaries_give_each_document_its_own_logits(tmp_path: Path, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    sentences = [s.strip() + "." for doc in corpus_documents(30) for s in doc.split(".") if 10 < len(s.strip()) < 40]
    split = _split(tmp_path, model_dir, sentences[:60])
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    kept, crossed = (WrappedWindows(split, SEQ, boundaries, pad_id=0) for boundaries in (True, False))
    checked = 0
    for index in range(4):
        item = kept[index]
        positions = item["position_ids"]
        starts = [0] + [t for t in range(1, SEQ) if positions[t] == 0]
        assert len(starts) >= 3  # several documents in one window
        with torch.no_grad():
            packed = model(input_ids=item["input_ids"][None], position_ids=positions[None]).logits[0]
            assert crossed[index]["position_ids"].tolist() == list(range(SEQ))
            unmasked = model(input_ids=crossed[index]["input_ids"][None]).logits[0]
            for start, stop in zip(starts, starts[1:] + [SEQ]):
                alone = model(input_ids=item["input_ids"][None, start:stop]).logits[0]
                torch.testing.assert_close(packed[start:stop], alone, atol=2e-5, rtol=1e-4)
                assert positions[start:stop].tolist() == list(range(stop - start))
                if start:  # no document predicts the next one's first token
                    assert item["labels"][start - 1] == IGNORE
                    assert not torch.allclose(unmasked[start:stop], alone, atol=1e-3)  # attention did cross there
                checked += 1
        assert (item["labels"] != IGNORE).sum() == SEQ - (len(starts) - 1)
    assert checked >= 12


def test_best_fit_decreasing_keeps_documents_whole(tmp_path: Path, model_dir: Path) -> None:
    lengths_wanted = [5, 17, 40, 64, 64, 3, 90, 33, 12, 61, 8, 150, 29]
    texts = [" ".join(["word"] * n) for n in lengths_wanted]
    split = _split(tmp_path, model_dir, texts)
    lengths = split.lengths()
    capacity = SEQ + 1
    for mode in ("keep_start", "keep_end", "drop"):
        arrays, stats = build_plan(lengths, capacity, mode)
        windows = PackedWindows(split, PackPlan(PlanArrays(None, arrays), capacity, mode), SEQ, pad_id=2)
        placed: list[int] = []
        for index in range(len(windows)):
            documents = windows.plan.documents_of(index)
            placed += documents
            used = sum(min(int(lengths[d]), capacity) for d in documents)
            assert used <= capacity
            item: dict[str, Any] = windows[index]
            assert (item["labels"] != IGNORE).sum() == used - len(documents)  # none across a boundary
            assert item["input_ids"][used:].tolist() == [2] * (SEQ - used)  # padding after the documents
        over = [d for d in range(len(lengths)) if lengths[d] > capacity]
        expected = [d for d in range(len(lengths)) if not (mode == "drop" and d in over)]
        assert sorted(placed) == expected
        assert (stats.dropped if mode == "drop" else stats.truncated) == len(over) > 0
        assert stats.fill > 0.7
    first = windows.plan.documents_of(0)
    assert all(lengths[d] <= capacity for d in first)


def test_a_truncated_document_keeps_its_start_or_its_end(tmp_path: Path, model_dir: Path) -> None:
    split = _split(tmp_path, model_dir, [" ".join(str(i) for i in range(200))])
    whole = split.token_slice(0, split.tokens)
    for mode, kept in (("keep_start", whole[:SEQ + 1]), ("keep_end", whole[-(SEQ + 1):])):
        arrays, _ = build_plan(split.lengths(), SEQ + 1, mode)
        item = PackedWindows(split, PackPlan(PlanArrays(None, arrays), SEQ + 1, mode), SEQ, pad_id=0)[0]
        assert np.array_equal(item["input_ids"].numpy(), kept[:-1].astype(np.int64))


def _windows_of(ctx: object, spec: str, model_dir: Path, cache: Path, seq: int) -> dict[str, Any]:
    """Every window (a digest of each) of `spec`, packed and wrapped, and this rank's share of
    the first two optimizer steps of 4 windows (collective where a group is formed)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found: dict[str, Any] = {}
    for packing in ("bfd", "wrapped"):
        windows = text_datasets((spec,), (), AutoTokenizer.from_pretrained(model_dir), model_dir, TextFormat(), 0.0,
                                WindowOptions(seq, packing, True, "keep_start", 2), cache, 0, 400, "model").train
        stream = BatchStream(windows, 4 // ranks, rank, ranks, seed=3, device=torch.device("cpu"), samples_per_step=4)
        steps = [next(stream) for _ in range(2)]
        found[packing] = {"all": [_digest(windows[i]) for i in range(len(windows))],  # type: ignore[arg-type]
                          "steps": [sorted(_digest({k: v[j] for k, v in batch.items()}) for j in range(4 // ranks))
                                    for batch in steps]}
    return found


def _digest(item: dict[str, torch.Tensor]) -> str:
    return hashlib.sha1(item["input_ids"].numpy().tobytes() + item["labels"].numpy().tobytes()).hexdigest()[:16]


_READ_ONLY_RANKS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from tests.multiproc import run_ranks
    from tests.test_text_windows import _windows_of
    print(json.dumps(run_ranks(_windows_of, 2, sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))))
""")


def _read_only(folder: Path, command: list[str]) -> list[str]:
    """`command` run where `folder` cannot be written: for root (whom permissions do not stop),
    in a mount namespace where it is bound read-only (EROFS, a read-only mount); else with its
    write permissions taken away (EACCES, another user's cache)."""
    if os.geteuid() != 0:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        return command
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && ! touch "$0/.probe"',
                            str(folder)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here (unshare -rm: {probe.stderr.decode().strip()[-200:]})")
    return ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(folder), *command]


def test_a_read_only_cache_plans_in_memory_the_same_windows_on_every_rank(tmp_path: Path, model_dir: Path) -> None:
    spec = str(write_jsonl(tmp_path / "chat.jsonl", conversations(40)))
    cache = tmp_path / "cache"
    _windows_of(None, spec, model_dir, cache, 255)  # a shared cache built and planned for one window size
    shutil.copytree(cache, tmp_path / "writable")
    seq = 100  # a size it holds no plan for, at which some conversations are cut before their answer
    expected = _windows_of(None, spec, model_dir, tmp_path / "writable", seq)
    before = sorted(path.name for path in cache.rglob("*"))
    command = _read_only(cache, [sys.executable, "-c", _READ_ONLY_RANKS, spec, str(model_dir), str(cache), str(seq)])
    result = subprocess.run(command, capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(result.stdout.strip().splitlines()[-1])
    held = "; planned in memory, as the cache entry cannot be written"
    assert re.search(rf"[1-9][0-9]* dropped with no target in the part a window keeps{held}", result.stderr)
    assert re.search(rf"\([1-9][0-9]* dropped with no target in them{held}", result.stderr)
    assert sorted(path.name for path in cache.rglob("*")) == before  # nothing was written
    for packing in ("bfd", "wrapped"):
        assert ranks[0][packing]["all"] == ranks[1][packing]["all"] == expected[packing]["all"], packing
        for step in range(2):  # step k holds the same windows on 2 ranks as on 1
            together = sorted(ranks[0][packing]["steps"][step] + ranks[1][packing]["steps"][step])
            assert together == expected[packing]["steps"][step], packing
