"""--shard: the model, its gradients and the optimizer state sharded over the ranks (FSDP2), under
the promises DDP runs make: the same numerics, the agreed fp16 skip, crash-safe checkpoints
that resume bitwise and on other world sizes, export, and one-line refusals. Real torchrun
and real gloo ranks throughout."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddp_amp import DistContext, Session, TrainConfig
from ddp_amp.checkpoint import verify_checkpoint
from ddp_amp.checkpoint.sharded import sharded_tensors
from ddp_amp.export import main as export_main
from ddp_amp.train import main as train_main
from ddp_amp.metrics import QuietRunLog
from ddp_amp.parallel import ShardOptions
from ddp_amp.tasks import load_task
from ddp_amp.torch_api import TENSOR_PARALLEL
from ddp_amp.trainer import Trainer, seed_everything, session_for
from tests.multiproc import REPO_ROOT, in_turn, run_ranks, run_train, slow_writes_env
from tests.resume_harness import assert_bitwise_equal
from tests.torch_features import needs, needs_sharding

pytestmark = needs_sharding

LM = ["--task", "lm", "--task-opt", "emsize=32", "--task-opt", "nhid=32", "--task-opt", "vocab=300",
      "--task-opt", "tokens=20000", "--task-opt", "bptt=16", "--device", "cpu", "--precision", "fp32",
      "--batch-size", "8", "--eval-every", "3", "--log-every", "1"]
LM_OPTIONS = ("emsize=32", "nhid=32", "vocab=300", "tokens=20000", "bptt=16")


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _export(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    assert export_main([str(checkpoint), "--to", str(out), "--force"]) == 0
    return load_file(out)


def test_a_sharded_run_checkpoints_resumes_bitwise_and_on_4_2_and_1_ranks_and_exports(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # step 3 is written in the background (every rank its shards), the final step 6 synchronously
    first = run_train([*LM, "--shard", "--max-steps", "6", "--ckpt-every", "3", "--async-checkpoint",
                       "--run-dir", str(straight)], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "model=sharded: 2 x TransformerEncoderLayer and the model as the root" in first.stdout
    step3 = straight / "checkpoints" / "step-00000003"
    listed = set(verify_checkpoint(step3)["files"])  # every file, shards included, sized and hashed
    on_disk = {str(p.relative_to(step3)) for p in step3.rglob("*") if p.is_file()} - {"manifest.json"}
    assert listed == on_disk and {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata"} <= listed
    assert json.loads((step3 / "meta.json").read_text())["sharded"] == ["model", "optimizer"]
    recorded = json.loads((straight / "config.json").read_text())
    assert recorded["config"]["shard"] is True and recorded["model"].startswith("sharded: 2 x TransformerEncoderLayer")

    # Bitwise: from step 3 to 6 in another run, the same weights as the straight run's.
    again = run_train([*LM, "--shard", "--max-steps", "6", "--resume", str(step3), "--run-dir", str(resumed)],
                      nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["loss"] for r in _records(resumed) if "loss" in r and r["step"] > 3] == \
        [r["loss"] for r in _records(straight) if "loss" in r and r["step"] > 3]
    final = _export(straight / "checkpoints" / "step-00000006", tmp_path / "a.safetensors")
    assert_bitwise_equal(final, _export(resumed / "checkpoints" / "step-00000006", tmp_path / "b.safetensors"))

    # Another world size: DCP reshards; the data position maps as for DDP. Saved on 4 ranks,
    # resumed on 2, then on 1.
    for ranks, steps in ((4, 8), (2, 10), (1, 12)):
        more = run_train([*LM, "--shard", "--max-steps", str(steps), "--run-dir", str(straight)], nproc=ranks)
        assert more.returncode == 0, more.stderr[-3000:]
        assert f"world_size={ranks}" in more.stdout and f"resume from {straight}/checkpoints" in more.stdout
    # The export loads strictly into the plain model of the task.
    config = TrainConfig(task="lm", task_opt=LM_OPTIONS)
    plain = load_task("lm", config).build_model()  # type: ignore[misc]  # the lm task builds its model
    weights = _export(straight, tmp_path / "c.safetensors")
    plain.load_state_dict(weights, strict=True)
    assert json.loads(Path(straight / "summary.json").read_text())["steps"] == 12


def test_replicated_and_sharded_checkpoints_resume_each_other(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for shard, steps in ((False, 3), (True, 6), (False, 9)):
        result = run_train([*LM, *(["--shard"] if shard else []), "--max-steps", str(steps), "--run-dir",
                            str(run_dir)], nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        if steps > 3:
            assert f"at step {steps - 3}" in result.stdout
    losses = [r["loss"] for r in _records(run_dir) if "loss" in r]
    # Trained on through every hand-over: the held-out NLL (smoother than a batch's loss at
    # the task's lr 5) fell from the start to the end.
    evals = [r["eval_nll"] for r in _records(run_dir) if "eval_nll" in r]
    assert len(losses) == 9 and evals[-1] < evals[0]


def test_keep_best_and_retention_on_sharded_checkpoints_and_the_test_pass_loads_the_best(tmp_path: Path) -> None:
    result = run_train([*LM, "--task", "tests.plugins.lm_tested_task:make_task", "--shard", "--max-steps", "12",
                        "--ckpt-every", "3", "--keep-last", "1", "--keep-best", "eval_ppl", "--lr", "20",
                        "--run-dir", str(tmp_path)], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = {r["step"]: r["eval_ppl"] for r in _records(tmp_path) if "eval_ppl" in r and r["step"] > 0}
    best_step = min(evals, key=evals.__getitem__)
    assert best_step < 12, evals  # the test pass must read a checkpoint back, not use the final weights
    kept = sorted(path.name for path in (tmp_path / "checkpoints").glob("step-*"))
    assert kept == [f"step-{best_step:08d}", "step-00000012"]  # --keep-last 1 spared the best
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_weights_from_step"] == best_step
    assert summary["test_ppl"] == pytest.approx(evals[best_step], rel=1e-6)


def _parity(ctx: DistContext, lr: float) -> dict[str, list[float]]:
    """Collective: the lm task in each precision with its SGD, and in fp32 with AdamW (lr 1e-3),
    replicated and sharded, the same 50 steps."""
    losses = {}
    for precision, optimizer in (("fp32", "sgd"), ("bf16", "sgd"), ("fp16", "sgd"), ("fp32", "adamw")):
        for shard in (False, True):
            config = TrainConfig(task="lm", task_opt=(*LM_OPTIONS, "dropout=0"), device="cpu", precision=precision,
                                 batch_size=8, max_steps=50, eval_every=0, log_every=10**6, shard=shard,
                                 lr=lr if optimizer == "sgd" else 1e-3,
                                 optimizer="auto" if optimizer == "sgd" else optimizer)  # auto: the task's SGD
            seed_everything(config.seed)
            task = load_task("lm", config)
            seed_everything(config.seed + ctx.rank)
            with session_for(config) as session:
                trainer = Trainer(session, config, task, QuietRunLog(ctx.rank))
                losses[f"{precision} {optimizer} {'sharded' if shard else 'replicated'}"] = \
                    [float(trainer.train_step()) for _ in range(config.max_steps)]
                del trainer
    return losses


def test_sharded_numerics_are_the_replicated_ones_in_every_precision() -> None:
    # lr 0.5, not the task's 5.0: at 5.0 two fp32 runs that differ only in the order of
    # their sums drift apart (docs/sharding.md has both).
    losses = run_ranks(_parity, 2, 0.5, timeout=600)[0]
    for optimizer in ("sgd", "adamw"):
        replicated, sharded = losses[f"fp32 {optimizer} replicated"], losses[f"fp32 {optimizer} sharded"]
        assert all(abs(s - r) <= 1e-5 * abs(r) for r, s in zip(replicated, sharded, strict=True)), \
            (optimizer, replicated, sharded)
    print({optimizer: max(abs(s - r) / abs(r) for r, s in zip(losses[f"fp32 {optimizer} replicated"],  # doc figures
                                                               losses[f"fp32 {optimizer} sharded"], strict=True))
           for optimizer in ("sgd", "adamw")}, {key: values[-1] for key, values in losses.items()})
    for precision in ("bf16", "fp16"):
        final = losses[f"{precision} sgd replicated"][-1], losses[f"{precision} sgd sharded"][-1]
        assert abs(final[1] - final[0]) <= 0.01 * abs(final[0]), (precision, final)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _one_rank_inf(ctx: DistContext, shard: bool, inf_at: tuple[int, ...], replicate: int = 1,
                  tensor_parallel: int = 1, ranks_per_batch: int = 1) -> dict[str, Any]:
    """fp16, an inf written into rank 1's part of one gradient at `inf_at`: the skips, the scales,
    the norms before clipping and the final weights, whole (collective). `replicate` > 1: HSDP;
    `tensor_parallel` > 1: the blocks split over that many ranks; `ranks_per_batch`
    consecutive ranks draw the same batch (a tensor-parallel group does)."""
    options = ShardOptions(replicate=replicate) if shard else None
    with Session("fp16", "cpu", backend="gloo", scaler_options={"init_scale": 256.0}, environ=os.environ,
                 shard=options, tensor_parallel=tensor_parallel) as session:
        torch.manual_seed(0)
        model = session.setup(_Blocks(), tensor_parallel_plan={"blocks.0": "colwise", "blocks.1": "rowwise"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        skipped, scales, norms = [], [], []
        for step in range(6):
            generator = torch.Generator().manual_seed(100 * step + ctx.rank // ranks_per_batch)
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
            with session.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            session.backward(loss)
            grad = session.unwrap(model).blocks[1].weight.grad
            if step in inf_at and ctx.rank == 1:  # this rank's part only: the other sees finite values
                (grad.to_local() if shard else grad)[0, 0] = float("inf")
            result = session.step(optimizer, clip_grad_norm=1.0)
            optimizer.zero_grad(set_to_none=True)
            skipped.append(int(result.skipped.item()))  # type: ignore[union-attr]
            scales.append(session.scaler.get_scale())
            norms.append(float(result.grad_norm))  # type: ignore[arg-type]  # clipped: a tensor
        weights = {name: (p.full_tensor() if shard else p).detach().clone()
                   for name, p in session.unwrap(model).named_parameters()}
    return {"skipped": skipped, "scales": scales, "norms": norms, "weights": weights}


def test_an_inf_in_one_ranks_shard_skips_the_step_on_every_rank() -> None:
    # Sharded, then DDP (rank 1's whole gradient) as the reference, in the same 2 processes.
    runs = run_ranks(in_turn, 2, (_one_rank_inf, True, (2, 4)), (_one_rank_inf, False, (2, 4)), timeout=300)
    sharded, reference = [run[0] for run in runs], [run[1] for run in runs]
    for rank in (0, 1):
        assert sharded[rank]["skipped"][2] == sharded[rank]["skipped"][4] == 1
        assert sharded[rank]["skipped"] == reference[rank]["skipped"] and \
            sharded[rank]["scales"] == reference[rank]["scales"]
        for name, weight in reference[rank]["weights"].items():
            torch.testing.assert_close(sharded[rank]["weights"][name], weight, rtol=1e-6, atol=1e-7)
    assert_bitwise_equal(sharded[0]["weights"], sharded[1]["weights"])


def _workers(torchrun: subprocess.Popen[str]) -> dict[int, int]:
    """rank -> pid of torchrun's workers (from each one's RANK)."""
    found = {}
    for child in psutil.Process(torchrun.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "ddp_amp.train" in " ".join(child.cmdline()):
            found[int(rank)] = child.pid
    return found


@pytest.mark.parametrize("split", [("--shard",), pytest.param(("--tensor-parallel", "2"),
                                                               marks=needs(TENSOR_PARALLEL))],
                         ids=["shard", "tensor-parallel"])
def test_a_rank_killed_inside_a_sharded_save_leaves_the_previous_checkpoint(split: tuple[str, ...],
                                                                            tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "ddp_amp.train", *LM, *split, "--max-steps", "9", "--ckpt-every", "3", "--run-dir", str(tmp_path)]
    # Each file of a checkpoint written 0.3 s slower (tests/slow_writes): the kill lands mid-save.
    proc = subprocess.Popen(command, env=slow_writes_env(0.3), cwd=REPO_ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(root.glob(".tmp-step-00000006-*/sharded/__1_*")):  # rank 1 is writing its step-6 shard
            assert proc.poll() is None and time.monotonic() < deadline, "never reached the step-6 save"
            time.sleep(0.02)
        os.kill(_workers(proc)[1], signal.SIGKILL)
        assert proc.wait(timeout=120) != 0  # the job fails: its rank 0 cannot finish the save alone
    finally:
        with contextlib.suppress(ProcessLookupError):  # what is left of the job, if anything
            os.killpg(proc.pid, signal.SIGKILL)
    assert (root / "step-00000003").is_dir() and not (root / "step-00000006").exists()
    verify_checkpoint(root / "step-00000003")
    again = run_train([*LM, *split, "--max-steps", "6", "--run-dir", str(tmp_path)], nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 3" in again.stdout and not list(root.glob(".tmp-*"))


def _refused(flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> str:
    """The one stderr line the CLI refuses `flags` with (exit code 2), having written nothing."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert train_main([*LM, *flags, "--max-steps", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_amp: error: --"), lines
    assert list(tmp_path.iterdir()) == []
    return lines[0]


@pytest.mark.parametrize("option", ["--static-graph", "--activation-checkpointing (without --shard)",
                                    "--shard-param-dtype bf16 (without --shard)", "--cpu-offload (without --shard)"])
def test_what_cannot_go_with_shard_is_one_line_before_anything_is_written(
        option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    flags = option.replace(" (without --shard)", "").split() + ([] if "without" in option else ["--shard"])
    assert "--shard" in _refused(flags, tmp_path, capsys, monkeypatch)


def test_cpu_offload_on_a_cpu_run_is_one_line_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    line = _refused(["--shard", "--cpu-offload"], tmp_path, capsys, monkeypatch)  # LM says --device cpu
    assert line.startswith("ddp_amp: error: --cpu-offload") and "(hint: drop --cpu-offload" in line


def test_bf16_gathers_train_close_to_fp32_ones_and_their_checkpoint_resumes_with_fp32_gathers(tmp_path: Path) -> None:
    losses = {}
    for dtype in ("fp32", "bf16"):
        result = run_train([*LM, "--shard", "--shard-param-dtype", dtype, "--lr", "0.5", "--max-steps", "20",
                            "--eval-every", "0", "--run-dir", str(tmp_path / dtype)], nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[dtype] = [r["loss"] for r in _records(tmp_path / dtype) if "loss" in r]
    assert "(parameters gathered in bf16)" in result.stdout
    assert all(math.isfinite(loss) for loss in losses["bf16"]) and losses["bf16"][-1] < losses["bf16"][0]
    # docs/sharding.md: over these 20 steps the bf16 gathers' loss stays within 0.5% of the
    # fp32 gathers' (measured 0.007%).
    assert abs(losses["bf16"][-1] - losses["fp32"][-1]) <= 0.005 * losses["fp32"][-1], losses
    # The shards are stored as the parameters are, fp32, whatever they were gathered in.
    step20 = tmp_path / "bf16" / "checkpoints" / "step-00000020"
    for key in ("model", "optimizer"):
        stored = {name: tensor.dtype for name, tensor in sharded_tensors(step20, key).items()
                  if tensor.is_floating_point() and tensor.dim()}
        assert set(stored.values()) == ({torch.float32} if stored or key == "model" else set()), stored
    resumed = run_train([*LM, "--shard", "--lr", "0.5", "--max-steps", "23", "--eval-every", "0", "--run-dir",
                         str(tmp_path / "bf16")], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 20" in resumed.stdout and "gathered in" not in resumed.stdout
    assert all(math.isfinite(r["loss"]) for r in _records(tmp_path / "bf16") if "loss" in r and r["step"] > 20)
