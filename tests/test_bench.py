"""`python -m ddp_amp.bench`: --help, and a tiny CPU run of every section with its JSON.

Structure and sanity only (every trial printed, ratios positive and finite); speed targets
are the benchmark's business, not the tests'.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.multiproc import REPO_ROOT, cli_env


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddp_amp.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(), cwd=REPO_ROOT)


def _sane_ratio(ratio: dict[str, Any]) -> None:
    for key in ("median", "q1", "q3", "min", "max"):
        assert math.isfinite(ratio[key]) and ratio[key] > 0, ratio
    assert ratio["min"] <= ratio["q1"] <= ratio["median"] <= ratio["q3"] <= ratio["max"], ratio
    assert ratio["pairs"] >= 2


def test_help_describes_every_section() -> None:
    result = _bench("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for word in ("--json", "--scale", "--sections", "overhead", "fastpaths", "GradScaler", "peak RSS",
                 "transformer", "MFU"):
        assert word in result.stdout, word


def test_bad_section_is_a_one_line_usage_error() -> None:
    result = _bench("--sections", "recipe,nope", timeout=60)
    assert result.returncode == 2
    assert "nope" in result.stderr and "Traceback" not in result.stderr


def test_tiny_cpu_run_prints_every_figure_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = _bench("--device", "cpu", "--scale", "0.004", "--batches", "2", "--epochs", "1",
                    "--blocks", "2", "--steps-per-block", "1", "--transformer-precisions", "fp32,fp8",
                    "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    for trial in ("fp32", "fp16", "bf16"):
        assert f"\n{trial} " in text, trial
    assert "trainer / hand-written recipe:" in text and "IQR" in text
    assert "Agreed overflow decision" in text and "agreed / unagreed" in text and "pinned non-blocking H2D copy" in text

    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["torch"] == __import__("torch").__version__
    assert report["date"] and report["device_name"]
    recipe = report["sections"]["recipe"]
    assert [t["precision"] for t in recipe["trials"]] == ["fp32", "fp16", "bf16"]
    for trial in recipe["trials"]:
        assert trial["total_s"] > 0 and trial["peak_mem_mb"] > 0 and trial["speedup_vs_fp32"] > 0
        assert math.isfinite(trial["final_loss"])
    host = report["sections"]["host"]
    assert [(r["loop"], r["precision"], r["ddp"]) for r in host["rows"]] == [
        (loop, p, ddp) for ddp in (False, True) for p in ("fp32", "bf16", "fp16") for loop in ("trainer", "session")]
    for row in host["rows"]:
        _sane_ratio(row["over_hand"])
        assert row["meets_target"] == (row["over_hand"]["median"] <= row["target"])
    assert "Host time per step" in text
    overhead = report["sections"]["overhead"]
    for model in ("recipe_model", "tiny_model"):
        _sane_ratio(overhead[model]["trainer_over_hand"])
        # every fp16 step of the Trainer with a peer agreed on its skip decision
        assert overhead[model]["agreements"] >= 2
    _sane_ratio(overhead["agreement_cost"]["agreed_over_unagreed"])
    assert overhead["agreement_cost"]["agreements"] >= 2
    rows = {row["name"]: row for row in report["sections"]["fastpaths"]["rows"]}
    assert "skipped" in rows["pinned non-blocking H2D copy"]
    measured = [row for row in rows.values() if "ratio" in row]
    assert len(measured) >= 5
    for row in measured:
        _sane_ratio(row["ratio"])
    transformer = report["sections"]["transformer"]
    rows = {row["precision"]: row for row in transformer["rows"]}
    assert set(rows) == {"fp32", "fp8"}
    assert "compute capability 8.9" in rows["fp8"]["skipped"]  # no float8 matmuls on a CPU: says why
    for name in ("fp32",):
        row = rows[name]
        _sane_ratio(row["trainer_over_hand"])
        assert row["tokens_per_s"] > 0 and row["flops_per_step"] > 0 and row["tflops"] > 0
        assert row["mfu"] is None  # no known peak on a CPU: no guessed MFU
    # 6 x parameters x tokens is the usual estimate of a step's matmul FLOPs; the count
    # leaves out embedding lookups and adds attention, so it lands near the estimate.
    estimate = 6 * transformer["parameters"] * transformer["shape"]["batch"] * transformer["shape"]["sequence"]
    assert 0.5 * estimate < rows["fp32"]["flops_per_step"] < 2 * estimate
    assert "Transformer: GPT-2-shaped decoder" in text and "fp8: not run" in text
