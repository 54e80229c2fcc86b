"""Which tokens the SFT loss covers (ddp_amp/data/encoding.py), compared with TRL's own
SFTTrainer on the same rows and tokenizer: its assistant-only mask for conversations (TRL
needs the template's generation markers; ddp_amp finds the same tokens without them) and its
completion-only mask for prompt/completion rows; then the masks through packed windows."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.data.encoding import Encoder, TextFormat
from ddp_amp.data.packing import PackPlan, build_plan
from ddp_amp.data.plan_store import PlanArrays
from ddp_amp.data.sources import resolve_source
from ddp_amp.data.token_cache import open_or_build
from ddp_amp.data.text_data import WindowOptions, text_datasets
from ddp_amp.data.windows import IGNORE, PackedWindows, WrappedWindows
from ddp_amp.errors import UsageError
from tests.text_model import TRAINING_TEMPLATE, conversations, make_model_dir, write_jsonl

COMPLETIONS = [{"prompt": "The for statement", "completion": " iterates over the items of a sequence."},
               {"prompt": "A class definition", "completion": " defines a class object."},
               {"prompt": "Q: what does pass do?\nA:", "completion": " nothing; it is a placeholder."}]
CONVERSATIONAL_COMPLETIONS = [{"prompt": [{"role": "user", "content": "What is a list?"}],
                               "completion": [{"role": "assistant", "content": "A mutable sequence."}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"), vocab_size=400, width=32, layers=1, heads=2)


def _trl() -> Any:
    try:
        import trl
        from trl import SFTTrainer  # noqa: F401 - what fails to import on an old torch
    except (ImportError, RuntimeError) as error:  # transformers' lazy import wraps an ImportError
        pytest.skip(f"TRL does not import on this torch ({str(error).strip().splitlines()[-1]})")
    return trl


def _trl_rows(model_dir: Path, rows: list[dict[str, Any]], tokenizer: Any = None,
              **options: Any) -> list[dict[str, Any]]:
    """TRL's tokenized rows (input_ids, labels with -100 outside the loss), as SFTTrainer prepares
    them (with `max_length`, truncated, and those left without a label dropped); `tokenizer`:
    the model directory's, with the tests' template marked for TRL, unless given."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trl = _trl()
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.chat_template = TRAINING_TEMPLATE  # the same rendering, with the generation markers TRL reads
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tokenizer))
    with warnings.catch_warnings():  # TRL's own defaults set an option transformers says is renamed
        warnings.simplefilter("ignore", FutureWarning)
        config = trl.SFTConfig(output_dir=tempfile.mkdtemp(), packing=False, report_to=[], use_cpu=True,
                               **{"max_length": None, **options})
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                                 processing_class=tokenizer)
    return [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]


def _ours(model_dir: Path, rows: list[dict[str, Any]], kind: str, **fmt: Any) -> list[tuple[list[int], list[int]]]:
    from transformers import AutoTokenizer
    encoded = Encoder(AutoTokenizer.from_pretrained(model_dir), TextFormat(**fmt)).encode(kind, rows, str)
    return [(ids, mask if mask is not None else [1] * len(ids)) for ids, mask in encoded]


def _trl_mask(row: dict[str, Any]) -> list[int]:
    return [0 if label == IGNORE else 1 for label in row["labels"]]


def test_the_assistant_mask_is_trls(model_dir: Path) -> None:
    rows = conversations(12)  # with and without a system turn, one and two assistant turns
    trl = _trl_rows(model_dir, rows, assistant_only_loss=True)
    for (ids, mask), theirs in zip(_ours(model_dir, rows, "messages"), trl):
        assert ids == theirs["input_ids"]
        assert mask == _trl_mask(theirs)
        assert 0 < sum(mask) < len(mask)


def test_the_completion_mask_is_trls(model_dir: Path) -> None:
    trl = _trl_rows(model_dir, COMPLETIONS)  # prompt/completion rows: completion-only loss by default
    for (ids, mask), theirs in zip(_ours(model_dir, COMPLETIONS, "prompt_completion"), trl):
        assert ids == theirs["input_ids"] and mask == _trl_mask(theirs)
    trl = _trl_rows(model_dir, CONVERSATIONAL_COMPLETIONS)
    (ids, mask), = _ours(model_dir, CONVERSATIONAL_COMPLETIONS, "prompt_completion")
    assert ids == trl[0]["input_ids"] and mask == _trl_mask(trl[0])


def test_the_loss_covers_every_token_when_asked(model_dir: Path) -> None:
    rows = conversations(3)
    for ids, mask in _ours(model_dir, rows, "messages", assistant_only_loss=False):
        assert mask == [1] * len(ids)
    trl = _trl_rows(model_dir, COMPLETIONS, completion_only_loss=False)
    for (ids, mask), theirs in zip(_ours(model_dir, COMPLETIONS, "prompt_completion", completion_only_loss=False), trl):
        assert ids == theirs["input_ids"] and mask == _trl_mask(theirs) == [1] * len(ids)


def test_trls_qwen2_5_template_also_trains_the_newline_after_each_assistant_header(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    # A tokenizer with Qwen2.5's own chat template: TRL swaps in its training variant, whose
    # generation markers start right after "<|im_start|>assistant", before the "\n" that the
    # generation prompt ends with. ddp_amp's assistant turn starts after the generation prompt.
    shipped = Path(_trl().__file__).parent / "chat_templates" / "qwen2_5.jinja"
    if not shipped.is_file():
        pytest.skip(f"this TRL ships no {shipped.name} (TRL 1.16 does)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = shipped.read_text()
    rows = conversations(6)
    ours = Encoder(tokenizer, TextFormat()).encode("messages", rows, str)
    trl = _trl_rows(model_dir, rows, tokenizer=tokenizer, assistant_only_loss=True)
    for (ids, mask), theirs, row in zip(ours, trl, rows):
        assert ids == theirs["input_ids"]
        only_trl = [t for t, (m, k) in enumerate(zip(mask, _trl_mask(theirs))) if k and not m]
        assert not [t for t, (m, k) in enumerate(zip(mask, _trl_mask(theirs))) if m and not k]
        assert len(only_trl) == sum(m["role"] == "assistant" for m in row["messages"])  # one token a turn
        for t in only_trl:
            assert tokenizer.decode(ids[t]) == "\n" and tokenizer.decode(ids[:t]).endswith("<|im_start|>assistant")


@pytest.mark.parametrize("completion_only_loss,assistant_only_loss",
                         [(True, True), (True, False), (False, True), (False, False)])
def test_conversational_completions_follow_both_options_as_trl(model_dir: Path, completion_only_loss: bool,
                                                                assistant_only_loss: bool) -> None:
    # A prompt of several turns (a system turn, an earlier assistant turn), then its completion.
    rows = [{"prompt": row["messages"][:-1], "completion": row["messages"][-1:]} for row in conversations(12)]
    options = {"completion_only_loss": completion_only_loss, "assistant_only_loss": assistant_only_loss}
    trl = _trl_rows(model_dir, rows, **options)
    ours = _ours(model_dir, rows, "prompt_completion", **options)
    for (ids, mask), theirs in zip(ours, trl):
        assert ids == theirs["input_ids"] and mask == _trl_mask(theirs)
    targets = sum(sum(mask) for _, mask in ours)
    everything = sum(len(ids) for ids, _ in ours)
    assert (targets == everything) == (not completion_only_loss and not assistant_only_loss)


def test_packed_windows_keep_the_masks(tmp_path: Path, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    rows = conversations(30)
    trl = _trl_rows(model_dir, rows, assistant_only_loss=True)
    write_jsonl(tmp_path / "chat.jsonl", rows)
    train, _ = open_or_build(resolve_source(str(tmp_path / "chat.jsonl"), "--data"),
                             AutoTokenizer.from_pretrained(model_dir), model_dir, TextFormat(), 0.0, tmp_path / "cache")
    capacity = max(len(row["input_ids"]) for row in trl) + 1  # no conversation is cut
    arrays, _ = build_plan(train.lengths(), capacity, "keep_start")
    windows = PackedWindows(train, PackPlan(PlanArrays(None, arrays), capacity, "keep_start"), capacity - 1, pad_id=0)
    assert len(windows) < len(rows)  # several conversations share windows
    kept = sorted(t for i in range(len(windows)) for t in windows[i]["labels"].tolist() if t != IGNORE)
    # Every label TRL keeps, except a conversation's first token (nothing in it precedes it).
    assert kept == sorted(t for row in trl for t in row["labels"][1:] if t != IGNORE)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_a_window_with_no_target_is_dropped_as_trl_drops_the_example(tmp_path: Path, model_dir: Path, mode: str,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    rows, seq = conversations(60), 48  # at 49 tokens, most conversations are cut before their first answer
    write_jsonl(tmp_path / "chat.jsonl", rows)
    options = WindowOptions(seq, "bfd", False, mode, pad_id=2)
    windows = text_datasets((str(tmp_path / "chat.jsonl"),), (), AutoTokenizer.from_pretrained(model_dir), model_dir,
                            TextFormat(), 0.0, options, tmp_path / "cache", 0, 400, "model").train
    labels = [windows[i]["labels"] for i in range(len(windows))]  # type: ignore[arg-type]  # map-style
    assert all((window != IGNORE).any() for window in labels)
    # TRL without packing: each row cut to max_length tokens (ours: a window's seq + 1), and the
    # rows left without a label dropped. The same rows remain, with the same labels.
    trl = _trl_rows(model_dir, rows, assistant_only_loss=True, max_length=seq + 1, truncation_mode=mode)
    assert len(windows) == len(trl) > 0  # type: ignore[arg-type]  # map-style
    assert (len(trl) < len(rows) // 2) == (mode == "keep_start")  # an end keeps the last answer
    kept = sorted(t for window in labels for t in window.tolist() if t != IGNORE)
    assert kept == sorted(t for row in trl for t in row["labels"][1:] if t != IGNORE)
    line = next(line for line in capfd.readouterr().err.splitlines() if "best-fit decreasing" in line)
    assert f", {len(rows) - len(trl)} dropped with no target in the part a window keeps" in line, line

    wrapped = text_datasets((str(tmp_path / "chat.jsonl"),), (), AutoTokenizer.from_pretrained(model_dir),
                            model_dir, TextFormat(), 0.0, WindowOptions(seq, "wrapped", True, mode, 2),
                            tmp_path / "cache", 0, 400, "model").train
    every = WrappedWindows(windows.split, seq, True, 2)  # type: ignore[attr-defined]  # PackedWindows
    trained = [i for i in range(len(every)) if (every[i]["labels"] != IGNORE).any()]
    assert 0 < len(trained) == len(wrapped) < len(every)  # type: ignore[arg-type]  # map-style
    assert all(torch.equal(wrapped[k]["input_ids"], every[i]["input_ids"]) for k, i in enumerate(trained))
    line = capfd.readouterr().err.splitlines()[-1]
    assert f"({len(every) - len(trained)} dropped with no target in them)" in line, line


def test_templates_and_rows_that_cannot_be_masked_are_refused(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}[{{ messages|length }}]"
                               "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(UsageError, match="renders a conversation's turns the same whatever follows"):
        Encoder(tokenizer, TextFormat()).encode("messages", conversations(1), lambda i: f"chat.jsonl, line {i + 1}")
    tokenizer.chat_template = None
    with pytest.raises(UsageError, match="a tokenizer with a chat template"):
        Encoder(tokenizer, TextFormat()).check("messages", "chat.jsonl")
    with pytest.raises(UsageError, match=r"chat.jsonl, line 1'?: expected a conversation with an assistant turn"):
        Encoder(AutoTokenizer.from_pretrained(model_dir), TextFormat()).encode(
            "messages", [{"messages": [{"role": "user", "content": "hi"}]}], lambda i: f"chat.jsonl, line {i + 1}")
