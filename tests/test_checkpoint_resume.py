"""Exact resume: N straight steps == k steps + save + load in a fresh trainer + (N - k) steps.

Real gloo ranks (tests/multiproc.py) and a world of one; fp32, bf16 and fp16 (with forced
overflow skips), k in the middle of an epoch, with gradient accumulation. Also what goes
into a checkpoint, precision changes on resume, and world-size changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddp_amp.checkpoint import safe_load, verify_checkpoint
from ddp_amp.trainer.resume import map_data_position
from ddp_amp.distributed import DistContext, init_distributed
from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError
from ddp_amp.session import Session
from tests.resume_harness import assert_bitwise_equal, build_trainer, config, straight_vs_resumed
from tests.multiproc import run_ranks

# (name, steps, resume_at, overrides). 2 ranks x micro 4 over 96 samples: 12 micro-batches
# per rank per epoch, so every k here is mid-epoch; fp32 crosses an epoch after resuming.
CASES: list[tuple[str, int, int, dict[str, Any]]] = [
    ("fp32", 16, 7, {"precision": "fp32"}),
    ("fp32_accum", 8, 3, {"precision": "fp32", "grad_accum": 2}),
    ("bf16", 6, 4, {"precision": "bf16"}),
    # loss x 100 overflows fp16 at the initial scale 2**16: steps 1-5 are skipped, k=3 is among them.
    ("fp16_accum", 10, 3, {"precision": "fp16", "grad_accum": 2, "task_opt": ("loss_mult=100",)}),
]


def _resume_cases(ctx: DistContext, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, steps, resume_at, overrides in CASES:
        expected, resumed, saved = straight_vs_resumed(ctx, Path(tmp) / name, steps, resume_at, **overrides)
        results[name] = (expected, resumed, str(saved))
    # Precision changes: an fp32 checkpoint under fp16 (fresh scaler), fp16 under bf16 (ignored).
    for source, target in (("fp32", "fp16"), ("fp16_accum", "bf16")):
        trainer = build_trainer(config(precision=target), ctx, None)
        trainer.load_checkpoint(Path(results[source][2]))
        lines = trainer.run_log.lines  # type: ignore[attr-defined]
        results[f"{source}->{target}"] = (lines, trainer.scaler.state_dict(), trainer.step)
    return results


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("resume2")
    return run_ranks(_resume_cases, 2, str(tmp), timeout=240)


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_two_ranks_resume_is_bitwise_exact(two_rank_results: list[dict[str, Any]], name: str) -> None:
    for rank, results in enumerate(two_rank_results):
        expected, resumed, _ = results[name]
        assert_bitwise_equal(expected, resumed, f"rank{rank}/{name}")
    if name.startswith("fp16"):
        expected = two_rank_results[0][name][0]
        assert 0 < expected["skipped"] < expected["step"], "the fp16 case must exercise skipped steps"
        assert expected["scaler"]["scale"] < 2.0**16


def test_checkpoint_contents_load_as_plain_data(two_rank_results: list[dict[str, Any]]) -> None:
    path = Path(two_rank_results[0]["fp32"][2])
    manifest = verify_checkpoint(path)
    assert set(manifest["files"]) == {"model.pt", "state.pt", "meta.json", "rng/rank-00000.pt", "rng/rank-00001.pt",
                                      "ranks/rank-00000.json", "ranks/rank-00001.json"}
    model_state = safe_load(path / "model.pt")  # weights_only=True, nothing allow-listed
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in model_state)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
    plain.load_state_dict(model_state)
    train = safe_load(path / "state.pt")
    assert train["step"] == 7 and train["samples_seen"] == 56
    assert train["data"] == {"epoch": 0, "batch_in_epoch": 7}
    assert {"optimizer", "scaler", "scheduler"} <= set(train)
    rng = [safe_load(path / "rng" / f"rank-{rank:05d}.pt") for rank in range(2)]  # a file per rank
    assert set(rng[0]) >= {"python", "numpy", "torch"}
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])  # each rank's own stream
    meta = __import__("json").loads((path / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["torch_version"] == torch.__version__
    assert meta["ddp_amp_version"] and meta["config"]["max_steps"] == 16
    assert meta["modules"] == ["model"] and meta["scaler_skipped_total"] == 0


def test_precision_change_on_resume(two_rank_results: list[dict[str, Any]]) -> None:
    lines, scaler_state, step = two_rank_results[0]["fp32->fp16"]
    assert step == 7 and scaler_state["scale"] == 2.0**16  # fresh scaler
    assert any("fresh scaler" in line for line in lines), lines
    lines, scaler_state, step = two_rank_results[0]["fp16_accum->bf16"]
    assert step == 3 and scaler_state == {}
    assert any("ignored" in line for line in lines), lines


def _single() -> DistContext:
    return init_distributed(DistEnv(), device="cpu")


def test_one_rank_resume_is_bitwise_exact(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    # The last: map-style data read by 2 DataLoader worker processes, resumed mid-epoch.
    for case, overrides in enumerate(({"precision": "fp32"}, {"precision": "fp16", "grad_accum": 2,
                                                              "task_opt": ("loss_mult=100",)},
                                      {"precision": "fp32", "num_workers": 2})):
        expected, resumed, _ = straight_vs_resumed(_single(), tmp_path / str(case), 9, 4, **overrides)
        assert_bitwise_equal(expected, resumed, str(overrides))


def test_world_size_change_maps_or_refuses(two_rank_results: list[dict[str, Any]]) -> None:
    # 2 ranks x micro 4 x 7 batches = 56 samples into the epoch; 1 rank x micro 8 -> batch 7.
    path = Path(two_rank_results[0]["fp32"][2])
    trainer = build_trainer(config(), _single(), None)
    trainer.load_checkpoint(path)
    assert trainer.stream.state_dict() == {"epoch": 0, "batch_in_epoch": 7} and trainer.step == 7
    notices = trainer.run_log.lines  # type: ignore[attr-defined]
    assert any("saved with 2 rank(s)" in line for line in notices)
    # micro 12 does not divide 56: refused with a hint, before anything is changed.
    odd = build_trainer(config(batch_size=12), _single(), None)
    before = {k: v.clone() for k, v in Session.unwrap(odd.model).state_dict().items()}
    with pytest.raises(UsageError, match="resume with 2 rank"):
        odd.load_checkpoint(path)
    assert_bitwise_equal(before, Session.unwrap(odd.model).state_dict())
    meta = {"world_size": 2, "micro_batch_size": 4, "batches_per_epoch": 12}
    at_epoch_end = {"epoch": 3, "batch_in_epoch": 12}
    assert map_data_position(meta, at_epoch_end, 3, 5, 6) == {"epoch": 4, "batch_in_epoch": 0}


def test_other_model_is_refused_with_hint(two_rank_results: list[dict[str, Any]]) -> None:
    trainer = build_trainer(config(task_opt=("hidden=32",)), _single(), None)
    with pytest.raises(UsageError, match=r"tensor\(s\) differ.*\[16, 8\] vs model \[32, 8\]"):
        trainer.load_checkpoint(Path(two_rank_results[0]["fp32"][2]))
    assert trainer.step == 0


@pytest.mark.cuda
def test_one_rank_resume_is_bitwise_exact_on_cuda(tmp_path: Path) -> None:
    ctx = init_distributed(DistEnv(), device="cuda")
    expected, resumed, saved = straight_vs_resumed(ctx, tmp_path, 9, 4, device="cuda", precision="fp16",
                                                   task_opt=("loss_mult=100",))
    assert "cuda" in safe_load(saved / "rng" / "rank-00000.pt")  # the GPU's RNG state travels too
    assert_bitwise_equal(expected, resumed, "cuda fp16")
