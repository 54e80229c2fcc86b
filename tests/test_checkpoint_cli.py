"""Bad input at the CLI: one line on stderr, a non-zero exit, and nothing already saved lost.

Also the pure pieces: manifest checks, newest-complete discovery with fallback, retention,
and refusal of a checkpoint that carries pickled code.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_amp.checkpoint import (commit_checkpoint, commit_directory, newest_complete, resolve_resume, safe_load,
                                step_dir_name, verify_checkpoint)
from ddp_amp.config import TrainConfig
from ddp_amp.checkpoint.manifest import MANIFEST_NAME, encode_manifest, read_manifest, record_of
from ddp_amp.errors import UsageError
from ddp_amp.export import main as export_main
from ddp_amp.train import main
from tests.resume_harness import TASK
from tests.multiproc import REPO_ROOT, cli_env
from tests.torch_features import needs_sharding

COMMON = ["--task", TASK, "--batch-size", "8", "--device", "cpu", "--log-every", "1000"]


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddp_amp: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _in_process_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI's main() here (no interpreter start-up); expect exit 2 and one line."""
    capsys.readouterr()
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_amp: error: "), lines
    return lines[0]


def _limited_file_size(limit: int) -> None:
    # A full disk as an unprivileged test can make one: writes past `limit` bytes fail with
    # EFBIG (Python ignores SIGXFSZ), midway through torch.save, as ENOSPC would.
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_bad_input_fails_in_one_line_and_keeps_saved_checkpoints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(COMMON + ["--max-steps", "2", "--run-dir", str(run_dir)]) == 0
    root = run_dir / "checkpoints"
    saved = _digests(root)
    assert "step-00000002/model.pt" in saved

    # Another model (wider hidden layer) in the same run directory, the option change
    # accepted: the shapes still refuse it.
    wider = ["--max-steps", "4", "--run-dir", str(run_dir), "--task-opt", "hidden=32", "--allow-change", "task_opt"]
    config_before = (run_dir / "config.json").read_bytes()
    line = _in_process_error(COMMON + wider, capsys)
    assert "tensor(s) differ" in line and "hint:" in line
    assert (run_dir / "config.json").read_bytes() == config_before  # the refused run wrote nothing

    # A full disk during the next save, with --keep-last 1: the error names the kept
    # checkpoint, and retention never ran because nothing new was committed.
    sizes = {name: (root / "step-00000002" / name).stat().st_size for name in ("model.pt", "state.pt")}
    assert sizes["model.pt"] < sizes["state.pt"]  # AdamW state: two more copies of the weights
    limit = (sizes["model.pt"] + sizes["state.pt"]) // 2
    full = subprocess.run([sys.executable, "-m", "ddp_amp.train", *COMMON, "--max-steps", "4",
                           "--keep-last", "1", "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=180, env=cli_env(), cwd=REPO_ROOT,
                          preexec_fn=lambda: _limited_file_size(limit))
    line = _one_line_error(full, code=3)  # a failed write is not bad input
    assert "step-00000004" in line and "File too large" in line and "step-00000002 is kept" in line, line
    assert _digests(root) == saved  # nothing lost, no partial step-4, no scratch left

    # A --resume PATH that does not exist.
    missing = ["--run-dir", str(run_dir), "--resume", str(tmp_path / "nope")]
    line = _in_process_error(COMMON + missing, capsys)
    assert line.startswith("ddp_amp: error: --resume=") and "--resume auto" in line

    # A run directory that cannot be created (under a regular file: fails even for root).
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _in_process_error(COMMON + ["--run-dir", str(blocker / "run")], capsys)
    assert "--run-dir" in line and "writable" in line
    assert _digests(root) == saved


def _files(step: int) -> dict[str, object]:
    return {"model.pt": {"w": torch.full((4,), float(step))}, "meta.json": b"{}"}


def test_discovery_skips_corrupt_and_partial_and_retention_keeps_last(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        commit_checkpoint(tmp_path / step_dir_name(step), _files(step), keep_last=3)
    (tmp_path / ".tmp-step-00000009-1").mkdir()  # a dead writer's leftovers
    commit_checkpoint(tmp_path / step_dir_name(5), _files(5), keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000005"]
    newest = tmp_path / "step-00000005" / "model.pt"
    data = bytearray(newest.read_bytes())
    data[-30] ^= 0xFF  # one flipped bit-pattern, same size: only the sha256 catches it
    newest.write_bytes(bytes(data))
    (tmp_path / "step-00000004" / MANIFEST_NAME).unlink()  # as if killed before the manifest
    warnings: list[str] = []
    assert newest_complete(tmp_path, warnings.append) == tmp_path / "step-00000003"
    assert "step-00000005" in warnings[0] and "sha256" in warnings[0]
    assert "step-00000004" in warnings[1] and "no manifest.json" in warnings[1]
    assert torch.equal(safe_load(tmp_path / "step-00000003" / "model.pt")["w"], torch.full((4,), 3.0))


def test_resaving_a_step_replaces_it_and_a_crash_midway_loses_nothing(tmp_path: Path) -> None:
    commit_checkpoint(tmp_path / step_dir_name(2), _files(2))
    commit_checkpoint(tmp_path / step_dir_name(5), _files(5))
    commit_checkpoint(tmp_path / step_dir_name(5), _files(50))  # the same step again (a fresh run in an old dir)
    assert torch.equal(safe_load(tmp_path / "step-00000005" / "model.pt")["w"], torch.full((4,), 50.0))
    # A crash between moving the old step-5 aside and renaming the new one in:
    (tmp_path / "step-00000005").rename(tmp_path / ".tmp-old-step-00000005-77")
    warnings: list[str] = []
    assert newest_complete(tmp_path, warnings.append) == tmp_path / ".tmp-old-step-00000005-77"
    assert not warnings


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_with_pickled_code_is_refused_unexecuted(tmp_path: Path) -> None:
    marker, evil = tmp_path / "pwned", tmp_path / "evil"
    commit_directory(evil, {"model.pt": {"w": _Payload(str(marker))}, "meta.json": b"{}"})
    verify_checkpoint(evil)  # a valid manifest does not make it safe
    with pytest.raises(UsageError, match="pickled objects or code, refused unexecuted"):
        safe_load(evil / "model.pt")
    assert not marker.exists()


@needs_sharding
def test_a_sharded_checkpoint_whose_map_holds_pickled_code_is_refused_unexecuted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DCP keeps its map of the shards as a pickle; resume and export read it restricted."""
    run = tmp_path / "run"
    assert main(["--task", "mlp", "--task-opt", "samples=64", "--batch-size", "8", "--device", "cpu",
                 "--precision", "fp32", "--shard", "--max-steps", "2", "--run-dir", str(run)]) == 0
    marker, evil = tmp_path / "pwned", tmp_path / "evil" / "step-00000002"
    shutil.copytree(run / "checkpoints" / "step-00000002", evil)
    (evil / "sharded" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    manifest = read_manifest(evil)
    manifest["files"]["sharded/.metadata"] = record_of(evil / "sharded" / ".metadata")
    (evil / MANIFEST_NAME).write_bytes(encode_manifest(manifest))
    verify_checkpoint(evil)  # a valid manifest does not make it safe
    capsys.readouterr()
    assert export_main([str(evil), "--to", str(tmp_path / "w.safetensors")]) == 2
    assert main(["--task", "mlp", "--task-opt", "samples=64", "--batch-size", "8", "--device", "cpu",
                 "--precision", "fp32", "--shard", "--max-steps", "4", "--resume", str(evil),
                 "--run-dir", str(tmp_path / "again")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("refused unexecuted" in line and ".metadata" in line for line in lines), lines
    assert not marker.exists()


def test_resume_choices_and_option_checks(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (3, 7):
        commit_checkpoint(root / step_dir_name(step), _files(step))
    assert resolve_resume("none", root, print) is None
    assert resolve_resume("auto", root, print) == root / "step-00000007"
    assert resolve_resume(str(root), tmp_path / "elsewhere", print) == root / "step-00000007"
    older = root / "step-00000003"
    assert resolve_resume(str(older), tmp_path / "elsewhere", print) == older
    (root / "step-00000003" / "meta.json").write_bytes(b"{} ")  # one byte more than listed
    with pytest.raises(UsageError, match="bytes, manifest says"):
        resolve_resume(str(root / "step-00000003"), root, print)
    assert resolve_resume("auto", tmp_path / "empty", print) is None
    for option in ("ckpt_every", "keep_last"):
        with pytest.raises(UsageError, match=option.replace("_", "-")):
            TrainConfig(**{option: -1})
