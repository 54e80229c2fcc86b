"""Context parallel on real gloo ranks: every window of a transformers Llama's batch split over 2 or 4
ranks (all-gather attention, load-balanced chunks), alone and with tensor parallel and sharding,
trains as one rank does.

`causal_lm` on a tiny Llama, fp32, 10 SGD steps with clipping, on two kinds of data: text windows
(causal mask only), and text packed with `boundaries=true` mixed with packed conversations under the
assistant-only mask (document masks, restarting positions, most labels masked). CP 2 on 2 ranks,
and CP 4, CP 2 x TP 2, CP 2 x shard 2 and CP 2 x replicate 2 on 4 ranks give the 1-rank run's step
losses within 1e-5 relative, and its held-out loss after them. Checkpoints move between cp degrees:
CP 2 x shard 2 -> shard 4 (CP 1) -> CP 4 on 4 ranks continue with the 1-rank run's losses within
1e-6 (every degree trained on the same windows). The logits of each rank's chunks equal the
unsplit window's at those positions (grouped-query heads, packed documents), and the gradients
summed over the ranks equal the unsplit ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.distributed import DistContext
from ddp_amp.torch_api import TENSOR_PARALLEL
from tests.multiproc import run_ranks
from tests.resume_harness import build_trainer, config
from tests.text_model import corpus_documents, make_model_dir, split_corpus, write_jsonl
from tests.torch_features import needs

pytestmark = needs(TENSOR_PARALLEL)  # FSDP2 over 2-d meshes, as tensor parallel needs it

STEPS, SEQ, BATCH = 10, 96, 8
DATA = ("text", "packed")
# (context parallel, tensor parallel, --shard, ranks): the shapes of the same global batch
SHAPES = {"cp2": (2, 1, False, 2), "cp4": (4, 1, False, 4), "cp2 x tp2": (2, 2, False, 4),
          "cp2 x shard2": (2, 1, True, 4), "cp2 x replicate2": (2, 1, False, 4)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return split_corpus(tmp_path_factory.mktemp("cp"))


def _config(corpus: dict[str, Path], data: str, context_parallel: int = 1, tensor_parallel: int = 1,
            shard: bool = False) -> Any:
    packed = data == "packed"
    return config(task="causal_lm", task_opt=(f"model={corpus['model']}", f"max_length={SEQ}",
                                              "lr_scheduler_type=constant", f"boundaries={str(packed).lower()}",
                                              "test_size=0.05"),
                  data=(str(corpus["text"]), *([f"{corpus['chat']}:0.5"] if packed else [])),
                  data_cache=str(corpus["cache"]), batch_size=BATCH, optimizer="sgd", lr=0.5, clip_grad_norm=1.0,
                  max_steps=STEPS, eval_every=0, context_parallel=context_parallel, tensor_parallel=tensor_parallel,
                  shard=shard)


def _losses(trainer: Any, steps: int) -> list[float]:
    return [trainer._mean_across_ranks(trainer.train_step()) for _ in range(steps)]


def _train(ctx: DistContext, corpus: dict[str, Path], root: Path, shapes: list[tuple[int, int, bool]],
           chain: list[tuple[int, bool, int]] | None = None) -> dict[str, Any]:
    """Collective: STEPS steps of each data kind in each of `shapes` (the losses and layout of each);
    then `chain`'s links in turn on the packed data, each resuming the one before (the losses)."""
    runs: dict[str, list[dict[str, Any]]] = {data: [] for data in DATA}
    for data in DATA:
        for context_parallel, tensor_parallel, shard in shapes:
            trainer = build_trainer(_config(corpus, data, context_parallel, tensor_parallel, shard), ctx, None)
            losses = _losses(trainer, STEPS)
            runs[data].append({"losses": losses, "layout": trainer.layout, "eval": trainer.evaluate()["eval_loss"]})
            del trainer
    chained: list[float] = []
    saved = None
    for context_parallel, shard, steps in chain or []:
        trainer = build_trainer(_config(corpus, "packed", context_parallel, 1, shard), ctx, root / "chain")
        if saved is not None:
            trainer.load_checkpoint(saved)
        chained += _losses(trainer, steps)
        saved = trainer.save_checkpoint()
        del trainer
    return {"runs": runs, "chained": chained}


@pytest.fixture(scope="module")
def trained(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cp-runs")
    four_names = [name for name, shape in SHAPES.items() if shape[3] == 4]
    four = run_ranks(_train, 4, corpus, root / "4", [SHAPES[name][:3] for name in four_names],
                     [(2, True, 3), (1, True, 3), (4, False, 4)], timeout=900)[0]
    pair = run_ranks(_train, 2, corpus, root / "2", [SHAPES["cp2"][:3]], timeout=600)[0]
    alone = run_ranks(_train, 1, corpus, root / "1", [(1, 1, False)], timeout=600)[0]
    results: dict[str, Any] = {"chain": four["chained"]}
    for data in DATA:
        results[data] = {"1 rank": alone["runs"][data][0], "cp2": pair["runs"][data][0],
                         **dict(zip(four_names, four["runs"][data]))}
    return results


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_split_sequences_train_as_one_rank_does(shape: str, data: str, trained: dict[str, Any]) -> None:
    alone, split = trained[data]["1 rank"], trained[data][shape]
    degree = SHAPES[shape][0]
    assert f"context parallel over {degree} ranks (all-gather attention)" in split["layout"], split["layout"]
    assert split["losses"] == pytest.approx(alone["losses"], rel=1e-5), (shape, split["losses"], alone["losses"])
    assert alone["losses"][-1] < alone["losses"][0]  # it trained
    assert split["eval"] == pytest.approx(alone["eval"], rel=1e-5), (split["eval"], alone["eval"])


def test_a_checkpoint_resumes_on_another_cp_degree_with_the_straight_runs_losses(trained: dict[str, Any]) -> None:
    straight = trained["packed"]["1 rank"]["losses"]
    assert trained["chain"] == pytest.approx(straight, rel=1e-6), (trained["chain"], straight)


def _chunks_against_whole(ctx: DistContext) -> dict[str, float]:
    """Collective: a tiny Llama with grouped-query heads (4 query, 2 key-value), a batch of 3 windows
    of 32 with documents packed in some (positions restarting), run whole on every rank and split
    over the world: the largest difference of the split logits from the whole ones at this rank's
    positions, and of the gradients summed over the ranks from the whole ones (relative)."""
    import torch.distributed as dist
    import transformers

    from ddp_amp.parallel import SequenceSplit, split_attention

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    torch.manual_seed(0)
    whole = transformers.LlamaForCausalLM(config)
    whole.config._attn_implementation = "sdpa"
    split_model = transformers.LlamaForCausalLM(config)
    split_model.load_state_dict(whole.state_dict())
    draws = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 32), generator=draws)
    positions = torch.stack([torch.arange(32), torch.cat([torch.arange(10), torch.arange(22)]),
                             torch.cat([torch.arange(5), torch.arange(20), torch.arange(7)])])
    weights = torch.randn(3, 32, 64, generator=draws)
    logits = whole(input_ids=ids, position_ids=positions).logits
    (logits * weights).sum().backward()
    split = SequenceSplit(dist.get_world_size(), dist.get_rank(), dist.group.WORLD)
    split_attention(split_model, split)
    batch = split.keep({"input_ids": ids, "position_ids": positions, "weights": weights})
    part = split_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    (part * batch["weights"]).sum().backward()
    worst = 0.0
    for (_, ref), (_, mine) in zip(whole.named_parameters(), split_model.named_parameters()):
        summed = mine.grad.clone()
        dist.all_reduce(summed)
        worst = max(worst, float((summed - ref.grad).abs().max() / ref.grad.abs().max()))
    return {"logits": float((part - split.keep(logits.detach())).abs().max()), "grads": worst}


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_ranks_chunks_have_the_unsplit_windows_logits_and_gradients(ranks: int) -> None:
    pytest.importorskip("transformers")
    for found in run_ranks(_chunks_against_whole, ranks, timeout=300):
        assert found["logits"] <= 1e-5 and found["grads"] <= 1e-5, found


def test_the_load_balanced_cut_pairs_an_early_chunk_with_a_late_one() -> None:
    from ddp_amp.parallel import SequenceSplit

    window = torch.arange(16).view(1, 16)
    kept = [SequenceSplit(4, rank, None).keep(window)[0].tolist() for rank in range(4)]
    assert kept == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(position for part in kept for position in part) == list(range(16))


def test_a_split_sequence_run_composes_with_the_run_options_through_the_cli(tmp_path: Path) -> None:
    """torchrun, CP 2: pretrained weights read in, bf16 compute and gathers, full activation
    checkpointing, clipping and evaluations; resumed with selective checkpointing; exported for
    from_pretrained, which attends with its own kernel, not the split one."""
    transformers = pytest.importorskip("transformers")
    import json

    from ddp_amp.export import main as export_main
    from ddp_amp.parallel.context_parallel import ATTENTION_NAME
    from tests.multiproc import run_train

    model = make_model_dir(tmp_path / "model", vocab_size=256, width=32, layers=2, heads=2, max_positions=64)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": d} for d in corpus_documents(30)])
    run = tmp_path / "run"
    base = ["--task", "causal_lm", "--task-opt", f"model={model}", "--task-opt", "max_length=32", "--task-opt",
            "test_size=0.05", "--data", str(text), "--data-cache", str(tmp_path / "cache"), "--device", "cpu",
            "--batch-size", "4", "--log-every", "1", "--eval-every", "2", "--context-parallel", "2",
            "--precision", "bf16", "--shard-param-dtype", "bf16", "--clip-grad-norm", "1.0", "--run-dir", str(run)]
    first = run_train([*base, "--init-weights", str(model), "--activation-checkpointing", "full", "--max-steps", "2"],
                      nproc=2, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "context parallel over 2 ranks (all-gather attention)" in first.stdout, first.stdout[-3000:]
    assert "activation checkpointing per unit" in first.stdout and "parameters gathered in bf16" in first.stdout
    assert "initial weights from" in first.stdout
    second = run_train([*base, "--activation-checkpointing", "selective", "--max-steps", "4"], nproc=2, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "at step 2" in second.stdout and "selective activation checkpointing per unit" in second.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(losses) == 4 and len(evals) >= 2 and all(0 < v < 20 for v in losses + evals), records

    out = tmp_path / "hf"
    assert export_main([str(run), "--to", str(out), "--hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config._attn_implementation != ATTENTION_NAME
    assert ATTENTION_NAME not in (out / "config.json").read_text()
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.randint(0, 200, (1, 16))).logits).all()


def _fp16_inf_on_one_rank(ctx: DistContext) -> dict[str, Any]:
    """Collective (2 ranks, CP 2, fp16): a tiny Llama's steps on one split window, an inf written into
    rank 1's part of one gradient at step 2: what each rank skipped, its scales and its norms."""
    import transformers

    from ddp_amp import Session

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    skipped, scales, norms = [], [], []
    with Session("fp16", "cpu", "gloo", scaler_options={"init_scale": 256.0}, context_parallel=2) as session:
        torch.manual_seed(0)
        model = session.setup(transformers.LlamaForCausalLM(config))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            ids = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(step))
            batch = session.split_sequences({"input_ids": ids[:, :-1], "labels": ids[:, 1:],
                                             "position_ids": torch.arange(32).expand(2, -1)})
            with session.autocast():
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
            session.backward(loss)
            if step == 2 and ctx.rank == 1:  # this rank's part only: the other sees finite values
                session.unwrap(model).model.layers[0].mlp.up_proj.weight.grad.to_local()[0, 0] = float("inf")
            result = session.step(optimizer, clip_grad_norm=1.0)
            optimizer.zero_grad(set_to_none=True)
            skipped.append(int(result.skipped.item()))  # type: ignore[union-attr]
            scales.append(session.scaler.get_scale())
            norms.append(float(result.grad_norm))  # type: ignore[arg-type]
    return {"skipped": skipped, "scales": scales, "norms": norms}


def test_an_inf_in_one_ranks_part_skips_the_fp16_step_on_every_rank_of_the_cp_group() -> None:
    pytest.importorskip("transformers")
    first, second = run_ranks(_fp16_inf_on_one_rank, 2, timeout=300)
    assert first["skipped"] == second["skipped"] == [0, 0, 1, 0], (first, second)
    assert first["scales"] == second["scales"] and first["scales"][2] == first["scales"][1] / 2, first
    assert first["norms"][3] == second["norms"][3] and math.isfinite(first["norms"][3])
