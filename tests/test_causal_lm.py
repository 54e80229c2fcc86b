"""The `causal_lm` task end to end, offline: a tokenizer trained with `tokenizers` and a small
Llama saved as a model directory; 2 gloo ranks with --shard fine-tune it from its weights on
text and conversations, the held-out loss falls, `export --hf` hands back a directory that
transformers loads (model and tokenizer) and generates from. A run resumed on 4, then 2, then
1 rank trains on the straight run's samples, step for step; a resume on changed data is
refused; bad input is one line, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.export import main as export_main
from ddp_amp.train import main as train_main
from tests.multiproc import run_train
from tests.text_model import conversations, corpus_documents, make_model_dir, write_jsonl
from tests.torch_features import needs_sharding

SEQ = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("corpus")
    documents = corpus_documents()
    paths = {"model": make_model_dir(folder / "model", vocab_size=512, width=64, layers=2, heads=2,
                                     max_positions=128),
             "text": write_jsonl(folder / "text.jsonl", [{"text": d} for d in documents[:-12]]),
             "eval": write_jsonl(folder / "eval.jsonl", [{"text": d} for d in documents[-12:]]),
             "chat": write_jsonl(folder / "chat.jsonl", conversations(200)),
             "cache": folder / "cache"}
    return paths


def _args(corpus: dict[str, Path], *extra: str) -> list[str]:
    return ["--task", "causal_lm", "--task-opt", f"model={corpus['model']}", "--task-opt", f"max_length={SEQ}",
            "--data-cache", str(corpus["cache"]), "--device", "cpu", "--precision", "fp32", "--batch-size", "8",
            "--log-every", "1", *extra]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@needs_sharding
def test_two_sharded_ranks_fine_tune_on_text_and_chat_and_the_export_generates(tmp_path: Path,
                                                                               corpus: dict[str, Path]) -> None:
    run = tmp_path / "run"
    result = run_train(_args(corpus, "--init-weights", str(corpus["model"]), "--data", str(corpus["text"]),
                             "--data", f"{corpus['chat']}:0.5", "--eval-data", str(corpus["eval"]), "--shard",
                             "--lr", "3e-3", "--max-steps", "30", "--eval-every", "15", "--run-dir", str(run)),
                       nproc=2, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model=sharded" in result.stdout and "world_size=2" in result.stdout
    evals = [r for r in _records(run) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 15, 30] and evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.3
    assert evals[-1]["eval_ppl"] == pytest.approx(2.718281828 ** evals[-1]["eval_loss"], rel=1e-6)

    out = tmp_path / "exported"
    assert export_main([str(run), "--to", str(out), "--hf"]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"} <= \
        {p.name for p in out.iterdir()}
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("The for statement", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 6
    assert tokenizer.decode(generated[0]).startswith("<s>The for statement")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|user|>hi</s><|assistant|>"


def test_a_run_resumed_on_4_then_2_then_1_ranks_trains_on_the_straight_runs_samples(
        tmp_path: Path, corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "text.jsonl"
    data.write_bytes(corpus["text"].read_bytes())
    # A constant LR: the legs' --max-steps differ, and a decay would follow each one's. Masked
    # conversations among the text: their windows hold unequal numbers of targets, and the step's
    # loss is still one token mean, however the global batch is split over ranks.
    common = _args(corpus, "--data", str(data), "--data", f"{corpus['eval']}:0.5", "--data", f"{corpus['chat']}:0.5",
                   "--lr", "1e-3", "--task-opt", "lr_scheduler_type=constant")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_main([*common, "--max-steps", "6", "--run-dir", str(straight)]) == 0
    for ranks, steps in ((4, 2), (2, 4)):
        leg = run_train([*common, "--max-steps", str(steps), "--run-dir", str(resumed)], nproc=ranks, timeout=600)
        assert leg.returncode == 0, leg.stderr[-3000:]
        assert f"world_size={ranks}" in leg.stdout
    capsys.readouterr()
    assert train_main([*common, "--max-steps", "6", "--run-dir", str(resumed)]) == 0
    assert "world_size=1" in capsys.readouterr().out
    losses = {name: [r["loss"] for r in _records(run) if "loss" in r and "eval_loss" not in r]
              for name, run in (("straight", straight), ("resumed", resumed))}
    assert len(losses["resumed"]) == 6
    assert losses["resumed"] == pytest.approx(losses["straight"], rel=1e-5, abs=1e-6)

    # The same paths with other content: refused in one line, unless accepted.
    data.write_text(data.read_text() + json.dumps({"text": "one more document"}) + "\n")
    capsys.readouterr()
    assert train_main([*common, "--max-steps", "8", "--run-dir", str(resumed)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[ddp_amp] data:")]
    assert len(err) == 1 and err[0].startswith("ddp_amp: error: --data="), err  # one line
    assert "its content changed since the checkpoint" in err[0] and "--allow-change data" in err[0]
    assert max(r.get("step", 0) for r in _records(resumed)) == 6  # nothing was trained or written
    assert train_main([*common, "--max-steps", "8", "--allow-change", "data", "--run-dir", str(resumed)]) == 0


def _refusal(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    run = tmp_path / "refused"
    capsys.readouterr()
    assert train_main([*argv, "--max-steps", "2", "--run-dir", str(run)]) == 2
    # One error line; the data lines before it say what was tokenized (a cache reused later).
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[ddp_amp] data:")]
    assert len(err) == 1 and err[0].startswith("ddp_amp: error: ") and not run.exists(), err
    return err[0].replace("'", "")  # a value is quoted where it holds spaces or a path


def test_bad_input_is_one_line_and_nothing_is_written(tmp_path: Path, corpus: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    text = ["--data", str(corpus["text"])]
    assert "--data=(none): expected at least one source" in _refusal(_args(corpus), tmp_path, capsys)
    assert "--task lm does not" in _refusal(["--task", "lm", *text], tmp_path, capsys)
    assert "max_length=500: expected at most the models max_position_embeddings (128)" in _refusal(
        [*_args(corpus, *text), "--task-opt", "max_length=500"], tmp_path, capsys)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((corpus["model"] / "config.json").read_bytes())
    assert "expected a model directory with its tokenizer" in _refusal(
        [*_args(corpus, *text), "--task-opt", f"model={bare}"], tmp_path, capsys)
    no_template = tmp_path / "no_template"
    no_template.mkdir()
    for path in corpus["model"].iterdir():
        if path.name != "chat_template.jinja":
            (no_template / path.name).write_bytes(path.read_bytes())
    assert "expected a tokenizer with a chat template" in _refusal(
        [*_args(corpus, "--data", str(corpus["chat"])), "--task-opt", f"model={no_template}"], tmp_path, capsys)
    small = tmp_path / "small_vocab"
    small.mkdir()
    for path in no_template.iterdir():
        (small / path.name).write_bytes(path.read_bytes())
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    line = _refusal([*_args(corpus, *text), "--task-opt", f"model={small}"], tmp_path, capsys)
    assert "text.jsonl, line 1: expected token ids below the models vocab_size 300" in line
    # A truncated weights file is refused from its header, before the data is read or cached.
    truncated = tmp_path / "truncated.safetensors"
    weights = (corpus["model"] / "model.safetensors").read_bytes()
    truncated.write_bytes(weights[:len(weights) // 2])
    fresh_cache = tmp_path / "fresh_cache"
    line = _refusal([*_args(corpus, *text, "--init-weights", str(truncated)), "--data-cache", str(fresh_cache)],
                    tmp_path, capsys)
    assert "truncated.safetensors" in line and not fresh_cache.exists(), line
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    assert "expected at least one non-empty document" in _refusal(_args(corpus, "--data", str(empty)), tmp_path,
                                                                  capsys)
