"""ddp_amp.torch_api on the running torch: each feature's version claim holds here (it is
available exactly where every torch name it uses resolves), each private name it keeps
resolves, and a feature this torch is too old for is refused in one line naming the torch
it needs, before anything is written."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_amp.amp import AutocastModule, resolve_precision
from ddp_amp.env import detect_env
from ddp_amp.checkpoint.safe_types import SAFE_GLOBALS
from ddp_amp.errors import UsageError
from ddp_amp.parallel import ParallelPlan, ShardOptions
from ddp_amp.parallel.options import ParallelOptions
from ddp_amp.session.choices import FLAGS, resolve_choices
from ddp_amp.torch_api import (DCP_PICKLED_GLOBALS, DOCUMENT_MASKS, FEATURES, FUSED_TRANSFORMER_IGNORES_CPU_AUTOCAST,
                               GRAD_SCALER_INTERNALS, HSDP_OVER_GLOO, NEWER_TORCHRUN_OPTIONS, SHARDING, SUPPORTED,
                               TORCH_RELEASE, DTensor, Feature, FSDPModule, profiler_keeps_events, release,
                               safe_globals, torchrun_knows)
from ddp_amp.torchrun import without_unknown_options
from ddp_amp.train import main as train_main
from tests.multiproc import run_train
from tests.torch_features import needs_sharding


def _resolves(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


@pytest.mark.parametrize("feature", FEATURES, ids=lambda feature: feature.name)
def test_where_a_feature_is_available_every_torch_name_it_uses_resolves(feature: Feature) -> None:
    """Where it is claimed, every name resolves (a torch older than the names has a name
    missing: 2.4.1 lacks FSDP2's and selective recompute's, 2.5.1 FSDP2's; sharding's bound,
    2.7, is one release above its names', for what 2.6 does on a CPU)."""
    missing = [name for name in feature.uses if not _resolves(name)]
    if feature.available():
        assert not missing, (torch.__version__, feature.needs, missing)
    if TORCH_RELEASE < (2, 5) and feature.uses:
        assert missing, (torch.__version__, feature.name)


def test_the_running_torch_is_in_the_supported_range() -> None:
    low, high = SUPPORTED
    assert low <= TORCH_RELEASE < high
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}"' in pyproject


def test_release_reads_torch_version_strings() -> None:
    assert release("2.4.1+cu121") == (2, 4)
    assert release("2.16.0a0+git1234abc") == (2, 16)
    assert release("2.13.0") == (2, 13)
    with pytest.raises(ValueError, match="not a torch version"):
        release("nightly")


def test_a_refusal_is_one_line_naming_the_torch_it_needs_and_this_one() -> None:
    with pytest.raises(UsageError) as refused:
        SHARDING.require("--shard", True, version="2.6.0+cu124")
    message = str(refused.value)
    assert "\n" not in message
    assert "--shard=True" in message and "torch >= 2.7" in message and "this is torch 2.6.0+cu124" in message
    assert "pip install 'torch>=2.7'" in message
    SHARDING.require("--shard", True, version="2.7.1")  # new enough: nothing raised


@pytest.fixture
def sharding_from_torch_99(monkeypatch: pytest.MonkeyPatch) -> Feature:
    """Sharding as if it needed a torch no one has: its refusals, on any torch."""
    future = Feature(SHARDING.name, (99, 0), SHARDING.uses)
    monkeypatch.setattr("ddp_amp.parallel.plan.SHARDING", future)
    return future


def test_every_way_to_ask_for_sharding_is_refused_where_torch_lacks_it(sharding_from_torch_99: Feature) -> None:
    for ask in (lambda: ParallelOptions(shard=True).check(), lambda: ShardOptions(),
                lambda: ParallelPlan(shard=True)):
        with pytest.raises(UsageError, match=r"torch >= 99\.0 for sharding"):
            ask()
    ParallelOptions().check()  # DDP: nothing to refuse
    ParallelPlan()


def test_the_cli_refuses_sharding_with_exit_2_before_writing(sharding_from_torch_99: Feature, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert train_main(["--shard", "--task", "mlp", "--device", "cpu", "--run-dir", str(run_dir)]) == 2
    assert not run_dir.exists()
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--shard=True: expected torch >= 99.0 for sharding" in error


@needs_sharding
def test_hsdp_over_gloo_is_refused_where_torch_lacks_it_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ddp_amp.session.choices.HSDP_OVER_GLOO", Feature(HSDP_OVER_GLOO.name, (99, 0), ()))
    env = detect_env({})
    with pytest.raises(UsageError, match=r"--replicate=2: expected torch >= 99\.0 for HSDP"):
        resolve_choices("fp32", "cpu", "auto", env, False, ShardOptions(replicate=2), FLAGS)
    resolve_choices("fp32", "cpu", "auto", env, False, ShardOptions(replicate=1), FLAGS)  # no replicas: allowed
    assert not dist.is_initialized()


@pytest.mark.skipif(SHARDING.available(), reason=f"this torch ({torch.__version__}) shards")
def test_a_torch_too_old_to_shard_refuses_shard_in_one_line(tmp_path: Path) -> None:
    """On such a torch, for real: the CLI process imports, refuses and writes nothing."""
    run_dir = tmp_path / "run"
    result = run_train(["--shard", "--task", "mlp", "--device", "cpu", "--run-dir", str(run_dir)])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "torch >= 2.7 for sharding" in result.stderr
    assert not run_dir.exists()


def test_stand_ins_are_never_matched_and_refuse_when_called() -> None:
    """Where torch lacks sharding its classes are stand-ins: isinstance is False, calling refuses."""
    assert not isinstance(torch.zeros(1), DTensor)
    assert not isinstance(nn.Linear(1, 1), FSDPModule)
    if not SHARDING.available():
        with pytest.raises(UsageError, match=r"torch >= 2\.7"):
            FSDPModule()


def test_each_private_name_it_keeps_is_what_torch_holds_under_that_name() -> None:
    for (module, name), value in DCP_PICKLED_GLOBALS.items():
        assert getattr(importlib.import_module(module), name) is value
    scaler = torch.amp.GradScaler("cpu")
    missing = [name for name in GRAD_SCALER_INTERNALS if not hasattr(scaler, name)]
    assert not missing, f"torch {torch.__version__}'s GradScaler lacks {missing}"


def test_safe_globals_allows_inside_the_block_only(tmp_path: Path) -> None:
    path = tmp_path / "p.pt"
    torch.save({"where": Path("/data"), "step": np.int64(3)}, path)  # a numpy scalar: torch 2.4 needed more
    with safe_globals([type(Path("/data")), *SAFE_GLOBALS]):
        assert torch.load(path, weights_only=True) == {"where": Path("/data"), "step": np.int64(3)}
    with pytest.raises(Exception, match=r"(?i)weights.only"):
        torch.load(path, weights_only=True)


def _fused_path_fails_under_cpu_autocast() -> bool:
    with torch.random.fork_rng(devices=[]):
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.ones(1, 2, 8))
    except RuntimeError:
        return True
    return False


def test_a_transformer_evaluates_under_cpu_autocast_on_any_torch() -> None:
    """The claim about this torch's fused path holds, and the precision's autocast evaluates a
    transformer encoder either way (torch 2.4 and 2.5 failed in eval, the default task's)."""
    assert _fused_path_fails_under_cpu_autocast() == FUSED_TRANSFORMER_IGNORES_CPU_AUTOCAST
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2,
                                    enable_nested_tensor=False).eval()
    with torch.no_grad():
        out = AutocastModule(encoder, resolve_precision("bf16", torch.device("cpu")))(torch.ones(1, 3, 8))
    assert out.shape == (1, 3, 8) and torch.isfinite(out).all()
    assert torch.backends.mha.get_fastpath_enabled()  # switched back on after the region


def test_the_launchers_newer_torchrun_options_are_left_out_only_where_torchrun_lacks_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert torchrun_knows("--standalone") and not torchrun_knows("--no-such-option")
    argv = ["--standalone", "--signals-to-handle=SIGTERM,SIGUSR1", "--shutdown-timeout", "300", "--nproc-per-node=2",
            "-m", "ddp_amp.train", "--shutdown-timeout=5"]  # the script's own arguments are never touched
    lacking = [option for option in NEWER_TORCHRUN_OPTIONS if not torchrun_knows(option)]
    kept, dropped = without_unknown_options(argv)
    assert dropped == lacking and len(kept) == len(argv) - 2 * len(lacking) + ("--shutdown-timeout" in lacking)
    monkeypatch.setattr("ddp_amp.torchrun.torchrun_knows", lambda option: False)  # as torch 2.4's torchrun
    assert without_unknown_options(argv) == (["--standalone", "--nproc-per-node=2", "-m", "ddp_amp.train",
                                              "--shutdown-timeout=5"], ["--signals-to-handle", "--shutdown-timeout"])


def test_the_profiler_keeps_a_windows_events_on_every_torch() -> None:
    """torch 2.5 on takes acc_events; 2.4's profile has no such keyword (it raised TypeError)."""
    assert profiler_keeps_events() == ({"acc_events": True} if TORCH_RELEASE >= (2, 5) else {})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **profiler_keeps_events()) as prof:
        torch.ones(2) + 1
    assert prof.key_averages()


def test_kept_document_boundaries_are_refused_where_their_mask_would_be_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ddp_amp.config import TrainConfig
    from ddp_amp.tasks.causal_lm import read_options

    monkeypatch.setattr("ddp_amp.tasks.causal_lm.DOCUMENT_MASKS", Feature(DOCUMENT_MASKS.name, (99, 0), ()))
    with pytest.raises(UsageError, match=r"--task-opt boundaries='true': expected torch >= 99\.0 for attention kept"):
        read_options(TrainConfig(task="causal_lm", task_opt=("model=/models/m", "boundaries=true")))
    assert not read_options(TrainConfig(task="causal_lm", task_opt=("model=/models/m",)))["boundaries"]
