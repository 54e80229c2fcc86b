"""Tensor parallel on real gloo ranks: a transformers Llama split by its own plan (sequence and loss
parallel), alone and inside the data-parallel dimensions, trains as one rank does.

`causal_lm` on a tiny Llama (text and masked conversations, fp32, 10 SGD steps with clipping):
TP 2 on 2 ranks, TP 2 x shard 2 and TP 2 x replicate 2 on 4 give the 1-rank run's step losses
within 1e-5 relative, and its weights after the 10 steps within 1e-5. Checkpoints move between
shapes: TP 2 x shard 2 -> shard 4 -> TP 2 x replicate 2 on 4 ranks -> DDP on 2, and TP 2 on 2
ranks -> one rank, each continuing with the 1-rank run's losses within 1e-6 (so every shape
trained on the same windows at every step). Trainers are built in-process on
each rank as `ddp_amp.train` builds them; the module fixture runs every shape once (a process
group per world size) and the tests read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.distributed import DistContext
from ddp_amp.torch_api import TENSOR_PARALLEL, DTensor
from tests.multiproc import run_ranks
from tests.resume_harness import build_trainer, config, whole_state
from tests.text_model import split_corpus
from tests.torch_features import needs

pytestmark = needs(TENSOR_PARALLEL)

STEPS, SEQ, BATCH = 10, 96, 8
# (tensor parallel, --shard, ranks): the shapes of the same global batch
SHAPES = {"tp2": (2, False, 2), "tp2 x shard2": (2, True, 4), "tp2 x replicate2": (2, False, 4)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return split_corpus(tmp_path_factory.mktemp("tp"))


def _config(corpus: dict[str, Path], tensor_parallel: int = 1, shard: bool = False, **overrides: Any) -> Any:
    return config(task="causal_lm", task_opt=(f"model={corpus['model']}", f"max_length={SEQ}",
                                              "lr_scheduler_type=constant"),
                  data=(str(corpus["text"]), f"{corpus['chat']}:0.5"), data_cache=str(corpus["cache"]),
                  batch_size=BATCH, optimizer="sgd", lr=0.5, clip_grad_norm=1.0, max_steps=STEPS, eval_every=0,
                  tensor_parallel=tensor_parallel, shard=shard, **overrides)


def _losses(trainer: Any, steps: int) -> list[float]:
    return [trainer._mean_across_ranks(trainer.train_step()) for _ in range(steps)]


Chain = list[tuple[int, bool, int]]  # (tensor parallel, shard, steps) in turn, each resuming the one before


def _train(ctx: DistContext, corpus: dict[str, Path], root: Path, shapes: list[tuple[int, bool]],
           chains: list[tuple[Path | None, Chain]] | None = None, resume: Path | None = None) -> dict[str, Any]:
    """Collective: STEPS steps in each of `shapes` (the losses, whole weights and layout of each);
    each chain's links in turn, the first resuming the chain's checkpoint where it has one,
    each link resuming the one before and saving after its steps (the losses and the last
    checkpoint of each chain); `resume`: a checkpoint to continue to STEPS, replicated."""
    runs, chained = [], []
    for tensor_parallel, shard in shapes:
        trainer = build_trainer(_config(corpus, tensor_parallel, shard), ctx, None)
        runs.append({"losses": _losses(trainer, STEPS), "weights": whole_state(trainer.model),
                     "layout": trainer.layout})
        del trainer
    for index, (saved, links) in enumerate(chains or []):
        losses: list[float] = []
        for tensor_parallel, shard, steps in links:
            trainer = build_trainer(_config(corpus, tensor_parallel, shard), ctx, root / f"chain-{index}")
            if saved is not None:
                trainer.load_checkpoint(saved)
            losses += _losses(trainer, steps)
            saved = trainer.save_checkpoint()
            del trainer
        chained.append({"losses": losses, "saved": saved})
    resumed: list[float] = []
    if resume is not None:
        trainer = build_trainer(_config(corpus), ctx, root / "resumed")
        trainer.load_checkpoint(resume)
        resumed = _losses(trainer, STEPS - trainer.step)
    return {"runs": runs, "chained": chained, "resumed": resumed}


@pytest.fixture(scope="module")
def trained(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp-runs")
    results: dict[str, Any] = {}
    names = [name for name, shape in SHAPES.items() if shape[2] == 4]
    four = run_ranks(_train, 4, corpus, root / "4", [SHAPES[name][:2] for name in names],
                     [(None, [(2, True, 3), (1, True, 2), (2, False, 2)])], timeout=900)[0]
    results.update(zip(names, four["runs"]))
    # 2 ranks: TP 2; DDP continuing the 4 ranks' chain; TP 2 for 5 steps saved, for one rank to continue
    pair = run_ranks(_train, 2, corpus, root / "2", [SHAPES["tp2"][:2]],
                     [(four["chained"][0]["saved"], [(1, False, 3)]), (None, [(2, False, 5)])], timeout=900)[0]
    alone = run_ranks(_train, 1, corpus, root / "1", [(1, False)], [], pair["chained"][1]["saved"], timeout=600)[0]
    results["tp2"], results["1 rank"] = pair["runs"][0], alone["runs"][0]
    results["tp2 x shard2 -> shard4 -> tp2 x replicate2 -> ddp"] = (four["chained"][0]["losses"]
                                                                     + pair["chained"][0]["losses"])
    results["tp2 -> 1 rank"] = pair["chained"][1]["losses"] + alone["resumed"]
    return results


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_split_model_trains_as_one_rank_does(shape: str, trained: dict[str, Any]) -> None:
    alone, split = trained["1 rank"], trained[shape]
    assert split["layout"].startswith("tensor parallel over 2 ranks (sequence parallel, loss parallel)"), split
    assert split["losses"] == pytest.approx(alone["losses"], rel=1e-5), (shape, split["losses"], alone["losses"])
    assert alone["losses"][-1] < alone["losses"][0]  # it trained
    worst = max((_relative(split["weights"][name], value), name) for name, value in alone["weights"].items())
    assert worst[0] <= 1e-5, worst


@pytest.mark.parametrize("chain", ["tp2 x shard2 -> shard4 -> tp2 x replicate2 -> ddp", "tp2 -> 1 rank"])
def test_a_checkpoint_resumes_on_another_shape_with_the_straight_runs_losses(chain: str,
                                                                            trained: dict[str, Any]) -> None:
    straight = trained["1 rank"]["losses"]
    assert trained[chain] == pytest.approx(straight, rel=1e-6), (trained[chain], straight)


def test_a_split_run_reads_its_slices_of_pretrained_weights_and_exports_whole_ones(tmp_path: Path) -> None:
    """Through the CLI: --init-weights fills a TP 2 Llama (its tied head too) with each rank reading
    its slices, and export --hf hands back whole tensors that from_pretrained loads, logits equal
    to the run's final weights in a plain Llama."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from ddp_amp.export import main as export_main
    from tests.multiproc import run_train
    from tests.test_hf_weights import _args, _pretrained

    pretrained = tmp_path / "pretrained"
    original = _pretrained(pretrained)
    # 16 input tokens (seq 15 and the one it predicts from): sequence parallel splits them evenly
    result = run_train(_args(pretrained, tmp_path / "run", "--tensor-parallel", "2", "--max-steps", "3",
                             "--task-opt", "seq=15"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model=tensor parallel over 2 ranks (sequence parallel, loss parallel), replicated over 1 rank: " \
           "2 x LlamaDecoderLayer" in result.stdout, result.stdout[:2000]
    line = next(line for line in result.stdout.splitlines() if "initial weights from" in line)
    split = sum(p.numel() * p.element_size() for name, p in original.named_parameters() if "norm" not in name)
    norms = sum(p.numel() * p.element_size() for name, p in original.named_parameters() if "norm" in name)
    read = int(line.split(" bytes")[0].split(", ")[-1].replace(",", ""))
    assert "20 tensors" in line and read == split // 2 + norms, (line, split, norms)  # its half, the norms whole

    out = tmp_path / "hf"
    assert export_main([str(tmp_path / "run"), "--to", str(out), "--hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert export_main([str(tmp_path / "run"), "--to", str(tmp_path / "trained.safetensors")]) == 0
    trained = transformers.LlamaForCausalLM(original.config)
    trained.load_state_dict(load_file(tmp_path / "trained.safetensors"), strict=True)
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, trained.eval()(tokens).logits)
        moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), original.parameters()))
        assert 0 < moved < 0.01, moved  # trained from the pretrained weights, not from another init


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--tensor-parallel", "2"], "--tensor-parallel=2: expected a divisor of the ranks on a node (1)"),
    (["--tensor-parallel", "2", "--static-graph"], "--static-graph=True: expected an option that works with "
                                                   "--tensor-parallel"),
    (["--tensor-parallel", "2", "--replicate", "2"], "--replicate=2: expected --shard with it"),
    (["--context-parallel", "2"], "--context-parallel=2: expected a divisor of the world size (1)"),
    (["--context-parallel", "2", "--compile"], "--compile=True: expected no --compile with --context-parallel"),
    (["--context-parallel", "2", "--static-graph"], "--static-graph=True: expected an option that works with "
                                                    "--context-parallel"),
])
def test_a_layout_that_cannot_split_is_one_line_before_anything_is_written(
        flags: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddp_amp.train import main as train_main

    run = tmp_path / "run"
    assert train_main(["--task", "mlp", "--device", "cpu", "--max-steps", "2", "--run-dir", str(run), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "hint:" in lines[0], lines
    assert not run.exists()


def test_a_plan_that_cannot_split_the_model_is_one_line() -> None:
    """Checked on the model alone (a meta-device one will do): head counts, the modules a plan
    names, their kinds and sizes, a style unknown; a transformers model without a plan."""
    from torch import nn

    from ddp_amp import UsageError
    from ddp_amp.hf import model_tensor_parallel_plan
    from ddp_amp.parallel import TensorParallelPlan, check_plan

    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=6,
            num_key_value_heads=3))
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
        mlp = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    own = model_tensor_parallel_plan(llama)
    assert own is not None
    check_plan(llama, TensorParallelPlan(own.styles, own.divisible, own.source), 3)  # 6 and 3 heads: fine
    cases = [
        (llama, TensorParallelPlan(own.styles, own.divisible, own.source), 2, "num_key_value_heads (3)"),
        (mlp, TensorParallelPlan({"blocks.*.fc": "colwise"}), 2, "matches no Linear of the model"),
        (mlp, TensorParallelPlan({"0": "colwise", "1": "rowwise"}), 2, "1 is a ReLU; name the Linear"),
        (mlp, TensorParallelPlan({"0": "colwise", "2": "rowwise"}), 4, "divides 0.out_features (6)"),
        (mlp, TensorParallelPlan({"0": "diagonal"}), 2, "one of colwise, rowwise, embedding, head, norm"),
    ]
    for model, plan, degree, fragment in cases:
        with pytest.raises(UsageError) as refused:
            check_plan(model, plan, degree)
        assert fragment in str(refused.value) and "\n" not in str(refused.value), (fragment, str(refused.value))
    with pytest.raises(UsageError) as refused:
        model_tensor_parallel_plan(gpt2)
    assert "GPT2LMHeadModel has none" in str(refused.value) and "\n" not in str(refused.value)


FAMILIES = ("Qwen2", "Mistral", "Gemma")


def _family_step(ctx: DistContext) -> dict[str, dict[str, float]]:
    """Collective (2 ranks): for each family, one forward and backward of a tiny model split by its
    own plan, against the same model whole on this rank: the loss and the largest gradient
    difference, relative."""
    import transformers
    from torch import nn

    from ddp_amp import Session

    found: dict[str, dict[str, float]] = {}
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(3))  # the same on both ranks
    with Session("fp32", "cpu", "gloo", tensor_parallel=2) as session:
        for family in FAMILIES:
            config = getattr(transformers, f"{family}Config")(
                vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False)
            models = []
            for _ in range(2):  # the same weights twice: one whole, one to split
                torch.manual_seed(0)
                models.append(getattr(transformers, f"{family}ForCausalLM")(config))
            whole, split = models[0], session.setup(models[1])
            losses = {}
            for name, model in (("whole", whole), ("split", split)):
                with session.loss_parallel():
                    logits = model(input_ids=ids[:, :16]).logits
                    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
                    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                    loss.backward()
                losses[name] = float(loss)
            grads = dict(whole.named_parameters())
            worst = max(_relative(p.grad.full_tensor(), grads[name].grad)
                        for name, p in session.unwrap(split).named_parameters())
            found[family] = {"loss": abs(losses["split"] - losses["whole"]) / losses["whole"], "grad": worst,
                             "layout": session.describe(split)}
    return found


def test_qwen2_mistral_and_gemma_split_by_their_own_plans_compute_what_one_rank_does() -> None:
    """Qwen2's biased projections, Gemma's scaled embedding and (1 + weight) norms, Mistral:
    each family's own plan, with sequence and loss parallel, on 2 real ranks."""
    pytest.importorskip("transformers")
    for rank, found in enumerate(run_ranks(_family_step, 2, timeout=600)):
        for family in FAMILIES:
            assert found[family]["layout"].startswith("tensor parallel over 2 ranks (sequence parallel, loss "
                                                      "parallel)"), (rank, family, found[family])
            assert found[family]["loss"] < 1e-6 and found[family]["grad"] < 1e-5, (rank, family, found[family])
