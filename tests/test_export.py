"""`python -m ddp_amp.export`: a checkpoint's weights as a safetensors file a plain module loads.

Real checkpoints are trained in-process once per module (the `mlp` task under bf16 with
`--keep-best`, and a plugin task with tied weights). Each export is loaded with
`safetensors.torch.load_file` into a fresh plain model with `strict=True` and compared with
the checkpoint's `model.pt`, tensor by tensor: from the run directory (the checkpoint a
resume picks), from one step directory and with `--best`. A tampered or uncommitted
checkpoint, an existing output and a missing safetensors package are refused in one line,
with nothing written.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ddp_amp.checkpoint import commit_checkpoint, read_best, safe_load, step_dir_name
from ddp_amp.export import main as export_main
from ddp_amp.hf import storable_tensors
from ddp_amp.tasks.mlp import make_model
from ddp_amp.train import main as train_main
from ddp_amp.version import __version__
from tests.multiproc import REPO_ROOT, cli_env
from tests.plugins.tied_task import TiedLM

SIZES = {"in_size": 8, "hidden": 16, "out_size": 4, "layers": 3}
COMMON = ["--batch-size", "16", "--device", "cpu", "--log-every", "1000", "--eval-every", "1"]
# The eval mse falls as training goes on, so the largest one after training began is the
# first (step 1): `--keep-best eval_mse:max` keeps a best that is not the newest (step 3).
MLP_RUN = ["--task", "mlp", *[arg for key, value in SIZES.items() for arg in ("--task-opt", f"{key}={value}")],
           "--task-opt", "samples=256", "--precision", "bf16", "--lr", "0.01", "--max-steps", "3",
           "--keep-best", "eval_mse:max", "--keep-last", "1", *COMMON]
NEWEST, BEST = "step-00000003", "step-00000001"


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("export") / "mlp"
    assert train_main([*MLP_RUN, "--run-dir", str(run_dir)]) == 0
    return run_dir


def _checkpoint_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return safe_load(step_dir / "model.pt")


def _assert_same_tensors(exported: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert set(exported) == set(saved)
    for name, tensor in saved.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def _loads_into_plain_mlp(path: Path) -> dict[str, torch.Tensor]:
    weights = load_file(path)
    make_model(**SIZES).load_state_dict(weights, strict=True)  # raises on any missing or extra name
    return weights


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("ddp_amp: error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(path, framework="pt") as handle:
        return handle.metadata()


def test_a_run_exports_its_newest_checkpoint_into_a_plain_model(mlp_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    assert export_main([str(mlp_run), "--to", str(out)]) == 0
    _assert_same_tensors(_loads_into_plain_mlp(out), _checkpoint_weights(mlp_run / "checkpoints" / NEWEST))
    assert _metadata(out) == {"format": "pt", "step": "3", "precision": "bf16", "task": "mlp",
                              "ddp_amp_version": __version__, "checkpoint_ddp_amp_version": __version__}
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary file left


def test_one_step_directory_and_the_best_checkpoint_export(mlp_run: Path, tmp_path: Path) -> None:
    root = mlp_run / "checkpoints"
    record = read_best(root)
    assert record is not None and record.directory(root).name == BEST
    from_step, from_best = tmp_path / "step.safetensors", tmp_path / "best.safetensors"
    assert export_main([str(root / BEST), "--to", str(from_step)]) == 0
    assert export_main([str(mlp_run), "--best", "--to", str(from_best)]) == 0
    for path in (from_step, from_best):
        _assert_same_tensors(_loads_into_plain_mlp(path), _checkpoint_weights(root / BEST))
        assert _metadata(path)["step"] == "1"
    assert not torch.equal(load_file(from_best)["0.weight"], _checkpoint_weights(root / NEWEST)["0.weight"])


def test_tied_weights_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, out = tmp_path / "tied", tmp_path / "tied.safetensors"
    assert train_main(["--task", "tests.plugins.tied_task:make_task", "--max-steps", "2",
                       "--run-dir", str(run_dir), *COMMON]) == 0
    saved = _checkpoint_weights(run_dir / "checkpoints" / "step-00000002")
    assert saved["decoder.weight"].data_ptr() == saved["embedding.weight"].data_ptr()  # tied on disk
    capsys.readouterr()
    assert export_main([str(run_dir), "--to", str(out)]) == 0
    assert "decoder.weight = embedding.weight" in capsys.readouterr().err
    weights = load_file(out)
    _assert_same_tensors(weights, saved)
    model = TiedLM()
    model.load_state_dict(weights, strict=True)
    assert model.decoder.weight is model.embedding.weight  # still one Parameter
    assert torch.equal(model.embedding.weight, saved["embedding.weight"])
    assert _metadata(out)["shared_tensors"] == '{"decoder.weight": "embedding.weight"}'


def test_a_tampered_checkpoint_is_refused_in_one_line_and_nothing_is_written(mlp_run: Path, tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "model.safetensors"
    shutil.copytree(mlp_run, run_dir)
    model_file = run_dir / "checkpoints" / NEWEST / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 can tell
    model_file.write_bytes(bytes(data))

    refused = subprocess.run([sys.executable, "-m", "ddp_amp.export", str(model_file.parent), "--to", str(out)],
                             capture_output=True, text=True, timeout=60, env=cli_env(), cwd=REPO_ROOT)
    assert refused.returncode == 2
    line = _one_error_line(refused.stderr)
    assert str(model_file.parent) in line and "sha256" in line and "expected" in line and "hint:" in line
    assert list(tmp_path.iterdir()) == [run_dir]

    # From the run directory, the export takes what a resume would: the next older complete one.
    assert export_main([str(run_dir), "--to", str(out)]) == 0
    _assert_same_tensors(load_file(out), _checkpoint_weights(run_dir / "checkpoints" / BEST))


def test_an_uncommitted_checkpoint_is_refused(mlp_run: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    torn = tmp_path / "step-00000009"
    shutil.copytree(mlp_run / "checkpoints" / NEWEST, torn)
    (torn / "manifest.json").unlink()  # a write killed before its last file
    assert export_main([str(torn), "--to", str(tmp_path / "out.safetensors")]) == 2
    assert "no manifest.json" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out.safetensors").exists()


def test_an_existing_output_is_replaced_only_with_force(mlp_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"someone's file")
    assert export_main([str(mlp_run), "--to", str(out)]) == 2
    assert "--force" in _one_error_line(capsys.readouterr().err)
    assert out.read_bytes() == b"someone's file"
    assert export_main([str(mlp_run), "--to", str(out), "--force"]) == 0
    _loads_into_plain_mlp(out)


def test_without_safetensors_the_hint_says_what_to_install(mlp_run: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # makes the import fail
    assert export_main([str(mlp_run), "--to", str(tmp_path / "model.safetensors")]) == 2
    assert "pip install 'ddp_amp[export]'" in _one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_non_contiguous_tensors_and_extra_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A transposed (non-contiguous) weight, and a module's `_extra_state` that is not a tensor.
    transposed = torch.arange(12.0).reshape(3, 4).t()
    state = {"proj.weight": transposed, "proj.bias": torch.zeros(3),
             "proj._extra_state": {"amax_history": [1.0, 2.0]}}
    exported = storable_tensors(state)
    assert exported.skipped == ["proj._extra_state"]
    assert all(tensor.is_contiguous() for tensor in exported.tensors.values())

    root, out = tmp_path / "checkpoints", tmp_path / "model.safetensors"
    commit_checkpoint(root / step_dir_name(5),
                      {"model.pt": state, "rng.pt": {"ranks": []}, "meta.json": b'{"step": 5}'})
    assert export_main([str(root), "--to", str(out)]) == 0
    assert "proj._extra_state" in capsys.readouterr().err
    weights = load_file(out)
    assert set(weights) == {"proj.weight", "proj.bias"} and torch.equal(weights["proj.weight"], transposed)
    assert _metadata(out)["skipped_entries"] == '["proj._extra_state"]'
