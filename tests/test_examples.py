"""Every example in examples/ runs on 2 real gloo ranks under torchrun, and the property it
demonstrates holds: each example writes what every rank observed to a JSON file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc import REPO_ROOT, cli_env

EXAMPLES = REPO_ROOT / "examples"


def run_example(name: str, tmp_path: Path, nproc: int = 2, *args: str) -> list[dict[str, Any]]:
    """Run examples/NAME under torchrun (or plain python for nproc=0); return each rank's facts."""
    facts = tmp_path / "facts.json"
    script = [str(EXAMPLES / name), "--facts", str(facts), *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    result = subprocess.run([*launcher, *script], capture_output=True, text=True, timeout=240,
                            env=cli_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    data = json.loads(facts.read_text())
    assert data["world_size"] == max(nproc, 1)
    return data["ranks"]


def assert_replicas_equal(ranks: list[dict[str, Any]]) -> None:
    assert all(r["params"] == ranks[0]["params"] for r in ranks[1:]), "replicas drifted apart"


@pytest.mark.parametrize("nproc", [2, 0], ids=["torchrun-2", "plain-python"])
def test_accumulation_updates_scale_once_per_effective_batch(tmp_path: Path, nproc: int) -> None:
    ranks = run_example("accumulate.py", tmp_path, nproc)
    for facts in ranks:
        # init 256, growth_interval 1: one doubling per optimizer step (3 steps x 4 micro-batches).
        assert facts["scales"] == [512.0, 1024.0, 2048.0]
        assert facts["skipped"] == [0, 0, 0]
        # no_sync micro-batches + the synced last one == the fp32 gradient of the whole batch.
        assert facts["grad_rel_err"] < 1e-2
    assert_replicas_equal(ranks)


def test_clipping_acts_on_unscaled_gradients(tmp_path: Path) -> None:
    ranks = run_example("clip.py", tmp_path)
    for facts in ranks:
        max_norm = facts["max_norm"]
        assert not any(facts["skipped"])
        assert any(pre > max_norm for pre in facts["pre_clip"]), "clipping never engaged"
        # The reported norm is in real units: it matches an fp32 computation, not norm * scale.
        assert facts["pre_clip"][0] == pytest.approx(facts["reference_norm"], rel=2e-2)
        for pre, post in zip(facts["pre_clip"], facts["post_clip"]):
            assert post <= max_norm * (1 + 1e-3)
            if pre > max_norm:  # clipped to the threshold itself, not to max_norm / scale
                assert post == pytest.approx(max_norm, rel=1e-3)
    assert_replicas_equal(ranks)


def test_gradient_penalty_matches_fp32(tmp_path: Path) -> None:
    ranks = run_example("gradient_penalty.py", tmp_path)
    for facts in ranks:
        assert facts["scale"] > 1.0  # a forgotten unscale would be off by this factor
        assert facts["penalty_grad_rel_err"] < 1e-2
        assert facts["total_grad_rel_err"] < 1e-2
        assert not any(facts["skipped"])
    assert_replicas_equal(ranks)


def test_multiple_models_share_one_scaler_and_skip_together(tmp_path: Path) -> None:
    ranks = run_example("multiple_models.py", tmp_path)
    inject = ranks[0]["inject_step"]
    for facts in ranks:
        # Rank 1's local inf in model1 makes *every* rank skip optimizer 1, and only it.
        assert facts["skipped"] == [int(step == inject) for step in range(len(facts["skipped"]))]
        assert facts["model1_changed"] == [step != inject for step in range(len(facts["skipped"]))]
        assert all(facts["model0_changed"])
        # One backoff for the step, not one per optimizer; otherwise constant.
        scales = facts["scales"]
        assert scales[inject] == scales[inject - 1] / 2
        assert len(set(scales[:inject])) == 1 and len(set(scales[inject:])) == 1
    assert_replicas_equal(ranks)


def test_custom_autograd_functions_follow_autocast_rules(tmp_path: Path) -> None:
    ranks = run_example("custom_autograd.py", tmp_path)
    for facts in ranks:
        assert facts["matmul_forward_autocast"] and facts["matmul_backward_autocast"]
        assert facts["matmul_output_dtype"] == "torch.float16"
        # cast_inputs=float32: fp32 inputs, autocast off in forward and (restored) backward.
        assert facts["softplus_input_dtype"] == "torch.float32"
        assert facts["softplus_output_dtype"] == "torch.float32"
        assert not facts["softplus_forward_autocast"] and not facts["softplus_backward_autocast"]
        assert facts["grad_rel_err"] < 1e-2
        assert not any(facts["skipped"])
    assert_replicas_equal(ranks)


def test_inference_under_autocast_with_uneven_batches_and_checkpoint(tmp_path: Path) -> None:
    ranks = run_example("inference.py", tmp_path, 2, "--checkpoint", str(tmp_path / "model.pt"))
    assert [facts["eval"]["batches"] for facts in ranks] == [2, 3]  # no DDP collective per batch
    for facts in ranks:
        assert facts["eval"]["output_dtypes"] == ["torch.float16"]
        assert facts["eval"]["mse"] == pytest.approx(facts["fp32_mse"], rel=1e-2)
        assert facts["eval"]["mse"] == ranks[0]["eval"]["mse"]
        # Every rank restored rank 0's replica exactly, buffers included, and the step.
        assert facts["restored_state"] == ranks[0]["trained_state"]
        assert facts["restored_step"] == 3
        assert facts["optimizer_state_equal"] and facts["scale_unchanged_by_eval"]
    assert not list(tmp_path.glob(".model.pt.tmp-*")), "a temporary checkpoint file was left behind"


def test_unused_parameters_are_handled(tmp_path: Path) -> None:
    ranks = run_example("unused_parameters.py", tmp_path)
    for facts in ranks:
        assert all(facts["never_used_grad_is_none"]) and facts["never_used_unchanged"]
        assert facts["extra_head_changed"]  # on rank 0 too, via the averaged gradient
        assert not any(facts["skipped"])
    assert_replicas_equal(ranks)


def test_forward_in_worker_threads_runs_in_low_precision(tmp_path: Path) -> None:
    ranks = run_example("worker_threads.py", tmp_path)
    for facts in ranks:
        assert set(facts["train_output_dtypes"]) == {"torch.float16"}
        assert facts["threaded_output_dtypes"] == ["torch.float16"]
        assert facts["naive_output_dtypes"] == ["torch.float32"]  # what the wrapper prevents
        assert facts["threaded_matches_whole"]
        assert not any(facts["skipped"])
    assert_replicas_equal(ranks)
