"""`lm`: the corpus ships with Python, the split holds out unseen text, the model is causal."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.errors import UsageError
from ddp_amp.tasks import load_task
from ddp_amp.tasks.lm import UNK, ChunkDataset, TransformerLM, build_vocab, corpus_text, perplexity, tokenize


def test_corpus_is_real_english_text_from_the_standard_library() -> None:
    words = tokenize(corpus_text())
    assert len(words) > 100_000
    assert {"the", "function", "class", "return"} <= set(words)
    assert words == tokenize(corpus_text())  # same order every time: every rank agrees


def test_vocab_puts_unknown_first_and_honours_the_limit() -> None:
    vocab = build_vocab(["b", "a", "b", "c", "b", "a"], limit=3)
    assert vocab == {UNK: 0, "b": 1, "a": 2}


def test_chunks_pair_each_word_with_the_next() -> None:
    data = ChunkDataset(torch.arange(23), bptt=5)
    assert len(data) == 4  # (23 - 1) // 5: the last target still exists
    inputs, target = data[3]
    assert inputs.tolist() == [15, 16, 17, 18, 19] and target.tolist() == [16, 17, 18, 19, 20]


def test_task_holds_out_the_tail_and_decays_the_lr_once_per_epoch() -> None:
    config = TrainConfig(batch_size=16, task_opt=("tokens=20000", "bptt=10", "vocab=300"))
    task = load_task("lm", config)
    assert len(task.train_data) == (18000 - 1) // 10  # type: ignore[arg-type]
    assert len(task.eval_data) == 199  # type: ignore[arg-type]
    assert task.model is None and task.build_model is not None  # built by the trainer (sharded under --shard)
    model = task.build_model()
    assert model.decoder.out_features == 300
    assert (task.default_lr, task.default_clip_grad_norm) == (5.0, 0.5)
    optimizer = task.make_optimizer(model.parameters(), task.default_lr)  # type: ignore[misc]
    assert isinstance(optimizer, torch.optim.SGD)
    scheduler = task.make_scheduler(optimizer)  # type: ignore[misc]
    assert scheduler.step_size == len(task.train_data) // 16 and scheduler.gamma == 0.95  # type: ignore[attr-defined]


def test_model_is_causal_in_training_and_evaluation() -> None:
    torch.manual_seed(0)
    model = TransformerLM(ntoken=50, emsize=16, nhead=2, nhid=16, nlayers=2, dropout=0.0)
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 50
    for mode in (model.train, model.eval):
        mode()
        with torch.no_grad():
            before, after = model(tokens), model(changed)
        assert torch.equal(before[:, :7], after[:, :7])  # earlier positions never see word 7
        assert not torch.equal(before[:, 7:], after[:, 7:])


def test_perplexity_is_exp_of_the_mean_nll() -> None:
    assert perplexity({"nll": math.log(42.0)}) == pytest.approx({"nll": math.log(42.0), "ppl": 42.0})


@pytest.mark.parametrize(("option", "expected"), [
    ("emsize=0", "a number >= 1"), ("dropout=1.5", "< 1"), ("nhead=3", "a divisor of emsize=200"),
    ("width=3", "one of emsize"), ("tokens=20", "enough words for a held-out chunk"),
])
def test_bad_options_say_what_was_expected(option: str, expected: str) -> None:
    with pytest.raises(UsageError) as error:
        load_task("lm", TrainConfig(task_opt=(option,)))
    assert expected in str(error.value)
