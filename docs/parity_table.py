"""Print the markdown table of docs/parity.md from the run directories docs/parity.sh made.

Usage: python docs/parity_table.py runs/parity
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

PRECISIONS = ("fp32", "bf16", "fp16")
# task -> (summary key, label, scale for display, gap unit)
TASKS = {"lm": ("eval_ppl", "perplexity", 1.0, "%"), "digits": ("eval_accuracy", "accuracy %", 100.0, "points")}


def gap(task: str, value: float, reference: float) -> float:
    """Relative % for perplexity, percentage points for accuracy: the issue's tolerances."""
    return 100 * (value / reference - 1) if task == "lm" else 100 * (value - reference)


def control_name(out: Path) -> str:
    """The control parity.sh ran (2threads on CPU, cublaslt or noworkspace on a GPU), from the run names."""
    names = sorted({path.name.split("-")[2] for path in out.glob("*-fp32-*-seed*")})
    return names[0] if names else "2threads"


def control_gap(out: Path, task: str, seed: int, key: str, reference: float, unit: str) -> str:
    """fp32 run again under the control (the same arithmetic in another order) vs fp32: rounding alone."""
    path = out / f"{task}-fp32-{control_name(out)}-seed{seed}" / "summary.json"
    if not path.exists():
        return "-"
    return f"{gap(task, json.loads(path.read_text())[key], reference):+.2f} {unit}"


def main(out: Path) -> None:
    print("| task | metric | seed | fp32 | bf16 | fp16 | bf16 vs fp32 | fp16 vs fp32 | fp16 skipped steps"
          f" | control: fp32 {control_name(out)} vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for task, (key, label, scale, unit) in TASKS.items():
        means: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for seed in range(10):
            paths = {p: out / f"{task}-{p}-seed{seed}" / "summary.json" for p in PRECISIONS}
            if not all(path.exists() for path in paths.values()):
                continue  # a seed whose three runs are not all done
            runs = {p: json.loads(path.read_text()) for p, path in paths.items()}
            values = {p: runs[p][key] for p in PRECISIONS}
            for p in PRECISIONS:
                means[p].append(values[p])
            print(f"| {task} | {label} | {seed} | " + " | ".join(f"{values[p] * scale:.2f}" for p in PRECISIONS)
                  + f" | {gap(task, values['bf16'], values['fp32']):+.2f} {unit}"
                  + f" | {gap(task, values['fp16'], values['fp32']):+.2f} {unit} | {runs['fp16']['skipped_total']}"
                  + f" | {control_gap(out, task, seed, key, values['fp32'], unit)} |")
        if len(means["fp32"]) > 1:
            mean = {p: statistics.fmean(means[p]) for p in PRECISIONS}
            spread = (max(means["fp32"]) - min(means["fp32"])) * scale
            print(f"| {task} | {label} | mean of {len(means['fp32'])} (fp32 seed range {spread:.2f}) | "
                  + " | ".join(f"{mean[p] * scale:.2f}" for p in PRECISIONS)
                  + f" | {gap(task, mean['bf16'], mean['fp32']):+.2f} {unit}"
                  + f" | {gap(task, mean['fp16'], mean['fp32']):+.2f} {unit} | | |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/parity"))
