"""A damaged, truncated or missing shard file under a matching manifest is refused in one line:
`--resume auto` falls back to the previous complete checkpoint with a warning, a named PATH is
refused, and the export exits 2. Real torchrun, 2 gloo ranks, `--shard`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ddp_amp.checkpoint.manifest import encode_manifest, file_digest, read_manifest
from ddp_amp.checkpoint.rank_files import fold, leaf, record_name
from ddp_amp.export import main as export_main
from tests.multiproc import run_train
from tests.torch_features import needs_sharding

pytestmark = needs_sharding

LM = ["--task", "lm", "--task-opt", "emsize=32", "--task-opt", "nhid=32", "--task-opt", "vocab=300",
      "--task-opt", "tokens=20000", "--task-opt", "bptt=16", "--device", "cpu", "--precision", "fp32",
      "--batch-size", "8", "--eval-every", "0", "--log-every", "1", "--shard", "--ckpt-every", "3"]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the hash can tell
    path.write_bytes(bytes(data))


def _rewrite_manifest(checkpoint: Path) -> None:
    """Make each rank's record, and the manifest's digest over them, match the files as they
    are now (what a hand-edited copy looks like)."""
    manifest = read_manifest(checkpoint)
    leaves = []
    for rank in range(manifest["ranks"]["count"]):
        path = checkpoint / record_name(rank)
        record = json.loads(path.read_text())
        record["files"] = {name: {"size": (checkpoint / name).stat().st_size, "sha256": file_digest(checkpoint / name)}
                           for name in record["files"] if (checkpoint / name).is_file()}
        path.write_text(json.dumps(record))
        leaves.append(leaf(rank, file_digest(path)))
    manifest["ranks"]["digest"] = fold(leaves).hex()
    (checkpoint / "manifest.json").write_bytes(encode_manifest(manifest))


def _one_line_refusal(output: str) -> None:
    """No rank printed a traceback of its own (torchrun's summary of the exit is its own)."""
    assert "CheckpointException" not in output and "ddp_amp/checkpoint/" not in output, output[-3000:]


def test_a_damaged_shard_falls_back_under_auto_and_is_refused_by_path_and_by_export(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_train([*LM, "--max-steps", "6", "--run-dir", str(run_dir)], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    root = run_dir / "checkpoints"
    newest, older = root / "step-00000006", root / "step-00000003"
    _flip_a_byte(newest / "sharded" / "__1_0.distcp")  # rank 1's own shard: only rank 1 hashes it

    # A named PATH: refused on every rank, one ddp_amp line, nothing resumed.
    named = run_train([*LM, "--max-steps", "7", "--resume", str(newest), "--run-dir", str(tmp_path / "named")],
                      nproc=2)
    assert named.returncode != 0
    _one_line_refusal(named.stderr)
    assert any(line.startswith("ddp_amp") and "sha256 differs" in line and "__1_0.distcp" in line
               for line in named.stderr.splitlines()), named.stderr[-3000:]

    # The export hashes what it reads (every shard): exit 2, one line.
    assert export_main([str(newest), "--to", str(tmp_path / "x.safetensors")]) == 2

    # auto: the previous complete checkpoint, with a warning naming the damaged one.
    resumed = run_train([*LM, "--max-steps", "7", "--run-dir", str(run_dir)], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert f"skipping incomplete checkpoint {newest}" in output and "sha256 differs" in output
    assert f"resume from {older} at step 3" in output


def test_a_shard_missing_or_cut_short_under_a_matching_manifest_is_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    first = run_train([*LM, "--max-steps", "3", "--run-dir", str(run_dir)], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = run_dir / "checkpoints" / "step-00000003"
    for damage in ("missing", "truncated"):
        copy = tmp_path / damage / "step-00000003"
        shutil.copytree(checkpoint, copy)
        shard = copy / "sharded" / "__1_0.distcp"
        if damage == "missing":
            shard.unlink()
        else:
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        _rewrite_manifest(copy)
        capsys.readouterr()
        assert export_main([str(copy), "--to", str(tmp_path / f"{damage}.safetensors")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "shards' map" in err and "__1_0.distcp" in err, err
        resumed = run_train([*LM, "--max-steps", "4", "--resume", str(copy),
                             "--run-dir", str(tmp_path / f"r-{damage}")], nproc=2)
        assert resumed.returncode != 0
        _one_line_refusal(resumed.stderr)
        assert "shards' map" in resumed.stderr, resumed.stderr[-3000:]
    assert json.loads((checkpoint / "meta.json").read_text())["sharded"] == ["model", "optimizer"]
