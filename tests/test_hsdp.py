"""--shard --replicate R: HSDP, the model sharded within R replicas on a 2-D mesh. On 4 gloo
ranks as 2 replicas x 2 shards, through the real CLI under torchrun: the same numerics as
plain --shard and DDP (the clipped norm counts each replicated shard once), and checkpoints
that resume under the other layouts and world sizes, both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddp_amp.train import main as train_main
from ddp_amp.torch_api import HSDP_OVER_GLOO, TENSOR_PARALLEL
from tests.multiproc import in_turn, run_ranks, run_train
from tests.test_shard import LM, _one_rank_inf
from tests.torch_features import needs, needs_sharding

pytestmark = [needs_sharding, needs(HSDP_OVER_GLOO)]

# The lm task clips the norm at 0.5 by default (--clip-grad-norm 0); dropout off, as in
# test_shard's parity runs, so the layouts differ in the order of their sums alone.
HSDP_LM = [*LM, "--task-opt", "dropout=0", "--ckpt-every", "3"]
LAYOUTS = {"ddp": [], "shard": ["--shard"], "hsdp": ["--shard", "--replicate", "2"]}
# fp32 losses of the three layouts differ only in the order of their sums (a reduce-scatter
# of 2 or 4 parts, an all-reduce across replicas): measured within 1e-6 relative over 6 steps.
RELATIVE = 1e-5


def _losses(run_dir: Path, after: int = 0) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and r["step"] > after}


def _train(args: list[str], nproc: int) -> str:
    result = run_train(args, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _close(ours: dict[int, float], theirs: dict[int, float]) -> bool:
    return ours.keys() == theirs.keys() and all(abs(ours[s] - theirs[s]) <= RELATIVE * abs(theirs[s]) for s in ours)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Six steps on 4 ranks under DDP and HSDP, a checkpoint at step 3 and 6 of each (plain
    --shard against DDP is test_shard's)."""
    runs = {}
    for name, flags in LAYOUTS.items():
        if name == "shard":
            continue
        runs[name] = tmp_path_factory.mktemp(name)
        out = _train([*HSDP_LM, *flags, "--max-steps", "6", "--run-dir", str(runs[name])], nproc=4)
        if name == "hsdp":
            assert "model=sharded over 2 ranks, replicated 2 times: 2 x TransformerEncoderLayer" in out
    return runs


def test_hsdp_steps_the_losses_of_ddp_with_clipping_on(straight: dict[str, Path]) -> None:
    losses = {name: _losses(run_dir) for name, run_dir in straight.items()}
    assert len(losses["hsdp"]) == 6
    assert _close(losses["hsdp"], losses["ddp"]), losses
    print({name: max(abs(v[s] - losses["ddp"][s]) / abs(losses["ddp"][s]) for s in v)  # doc figures
           for name, v in losses.items()})


def test_hsdp_checkpoints_resume_under_shard_and_ddp_and_a_ddp_checkpoint_under_hsdp(
        straight: dict[str, Path], tmp_path: Path) -> None:
    def resume(layout: str, checkpoint_of: str, nproc: int) -> dict[int, float]:
        run_dir = tmp_path / f"{checkpoint_of}-as-{layout}-on-{nproc}"
        step3 = straight[checkpoint_of] / "checkpoints" / "step-00000003"
        out = _train([*HSDP_LM, *LAYOUTS[layout], "--max-steps", "6", "--resume", str(step3),
                      "--run-dir", str(run_dir)], nproc=nproc)
        assert f"resume from {step3} at step 3" in out and f"world_size={nproc}" in out
        return _losses(run_dir, after=3)

    after = {name: _losses(run_dir, after=3) for name, run_dir in straight.items()}
    # The same 4 ranks read the same data: the run goes on as the straight ones did.
    assert _close(resume("ddp", "hsdp", 4), after["ddp"])
    assert _close(resume("hsdp", "ddp", 4), after["hsdp"])
    # 2 ranks read other batches (the data position maps as for DDP), so their losses are
    # only of the same size as the 4 ranks' (below twice theirs: finite, not diverged).
    on_two = resume("shard", "hsdp", 2)
    assert sorted(on_two) == [4, 5, 6] and all(loss < after["ddp"][4] * 2 for loss in on_two.values()), on_two


def test_hsdp_clips_by_the_ddp_norm_and_an_inf_in_one_shard_skips_on_every_rank() -> None:
    # Rank 1 is shard 1 of replica 0: its inf must reach replica 1 (ranks 2, 3) as well. A
    # norm that summed each replica's shards again would be sqrt(2) times DDP's. Split over 2
    # ranks (TP 2) and sharded over the other 2, rank 1 holds a part of the split weight: its
    # inf must reach the other split pair too; ranks 0-1 and 2-3 each draw one batch, for all
    # three (DDP then averages the same two batches twice each).
    # All in the same 4 processes, one after the other (one start-up, not three).
    runs = run_ranks(in_turn, 4, (_one_rank_inf, True, (2, 4), 2, 1, 2), (_one_rank_inf, False, (2, 4), 1, 1, 2),
                     *([(_one_rank_inf, True, (2, 4), 1, 2, 2)] if TENSOR_PARALLEL.available() else []), timeout=300)
    hsdp, ddp, split = [run[0] for run in runs], [run[1] for run in runs], [run[2:] for run in runs]
    # Split, each rank's part of a rowwise product is rounded to fp16 under autocast before the
    # ranks' parts are summed, where one rank's matmul rounds the whole sum once: measured
    # 2.5e-5 relative on the norms; HSDP sums the same products as DDP, to fp32 rounding.
    for rank in range(4):
        for layout, within in [(hsdp[rank], 1e-6), *((each, 1e-3) for each in split[rank])]:
            assert layout["skipped"] == ddp[rank]["skipped"] == [0, 0, 1, 0, 1, 0]
            assert layout["scales"] == ddp[rank]["scales"]
            finite = [n for n, skipped in zip(ddp[rank]["norms"], ddp[rank]["skipped"], strict=True) if not skipped]
            assert max(finite) > 1.0  # the clip at 1.0 acted, so a wrong norm would show in the weights
            for ours, theirs, skipped in zip(layout["norms"], ddp[rank]["norms"], ddp[rank]["skipped"], strict=True):
                assert skipped or ours == pytest.approx(theirs, rel=within)
            for name, weight in ddp[rank]["weights"].items():
                torch.testing.assert_close(layout["weights"][name], weight, rtol=within, atol=within / 10)


@pytest.mark.parametrize("flags", [["--replicate", "2"], ["--shard", "--replicate", "2"]],
                         ids=["without-shard", "not-dividing-the-world"])
def test_a_bad_replicate_is_one_line_before_anything_is_written(
        flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # in this process: a world of one, which 2 does not divide
    capsys.readouterr()
    assert train_main([*LM, *flags, "--max-steps", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_amp: error: --replicate=2"), lines
    assert ("--shard" in lines[0]) if "--shard" not in flags else ("world size 1" in lines[0]), lines
    assert list(tmp_path.iterdir()) == []
