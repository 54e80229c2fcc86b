"""`python -m ddp_amp.report` on real run directories writes PNGs that decode at the set size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib import image

from ddp_amp.config import TrainConfig
from ddp_amp.report import DPI, FIGSIZE, read_run
from ddp_amp.report import main as report_main
from ddp_amp.train import train
from ddp_amp.trainer import session_for
from tests.multiproc import REPO_ROOT, cli_env, run_train

TINY = ["--task", "mlp", "--device", "cpu", "--max-steps", "30", "--log-every", "5", "--batch-size", "16",
        "--task-opt", "hidden=16", "--task-opt", "samples=256"]


def test_report_plots_overlaid_runs_with_skipped_steps(tmp_path: Path) -> None:
    fp16, fp32, out = tmp_path / "fp16", tmp_path / "fp32", tmp_path / "plots"
    # A start scale of 1e9 overflows for the first dozen steps: skipped steps to mark.
    result = run_train([*TINY, "--precision", "fp16", "--loss-scale-init", "1e9", "--run-dir", str(fp16)])
    assert result.returncode == 0, result.stderr
    config = TrainConfig(task="mlp", task_opt=("hidden=16", "samples=256"), max_steps=30, log_every=5, batch_size=16,
                         device="cpu", precision="fp32", run_dir=str(fp32))
    with session_for(config) as session:
        train(config, session)

    series = read_run(fp16)
    summary = json.loads((fp16 / "summary.json").read_text())
    events = [json.loads(line) for line in (fp16 / "metrics.jsonl").read_text().splitlines()]
    reported = sum(e["skipped"] for e in events if e.get("event") == "overflow")
    assert summary["skipped_total"] > 0 and reported == summary["skipped_total"]  # all reported
    # Skips are counted on the device and read at check steps (every log step here): the first
    # overflow report, and so the first mark, is at step 5.
    assert series.skipped_steps[0] == 5 and sorted(series.steps) == [5, 10, 15, 20, 25, 30]

    report = subprocess.run([sys.executable, "-m", "ddp_amp.report", str(fp16), str(fp32), "--out", str(out)],
                            capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=120)
    assert report.returncode == 0, report.stderr
    # mlp has no tokens, and a CPU no MFU: of the throughput charts only the FLOP rate's.
    names = ["loss.png", "loss_scale.png", "throughput.png", "memory.png", "flops.png"]
    assert report.stdout.split() == [str(out / n) for n in names]
    for name in names:
        pixels = image.imread(out / name)
        assert pixels.shape[:2] == (int(FIGSIZE[1] * DPI), int(FIGSIZE[0] * DPI)), name
        assert pixels.std() > 0.01, name  # something drawn, not a blank canvas


def test_report_on_a_directory_without_metrics_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err and str(tmp_path) in err


def test_report_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import` sees where it is absent
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'ddp_amp[plot]'" in err
