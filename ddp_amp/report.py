"""Plots of one or more runs: `python -m ddp_amp.report RUN_DIR [RUN_DIR ...] [--out DIR]`.

Writes four PNGs (800 x 450 pixels): `loss.png` (loss vs step, runs overlaid, e.g. fp32
vs fp16 vs bf16), `loss_scale.png` (log axis; skipped steps marked), `throughput.png`
(samples/s) and `memory.png` (peak MB). Needs matplotlib: `pip install 'ddp_amp[plot]'`.
Exit codes: 0 done, 2 bad input or matplotlib missing (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_amp.errors import UsageError
from ddp_amp.fast_exit import exit_process

FIGSIZE = (8.0, 4.5)  # inches; at DPI this is 800 x 450 pixels
DPI = 100


@dataclass
class RunSeries:
    """One run's logged steps, read from its metrics.jsonl."""

    label: str
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> last record for it
    skipped_steps: list[int] = field(default_factory=list)
    skip_scales: dict[int, float] = field(default_factory=dict)  # loss scale an overflow report saw

    def column(self, key: str) -> tuple[list[int], list[float]]:
        pairs = [(s, r[key]) for s, r in sorted(self.steps.items()) if isinstance(r.get(key), (int, float))]
        return [s for s, _ in pairs], [float(v) for _, v in pairs]


def read_run(run_dir: Path) -> RunSeries:
    """Parse `run_dir`/metrics.jsonl (and config.json for the label); raise UsageError if unusable."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError("RUN_DIR", str(run_dir), "a run directory holding metrics.jsonl",
                         "pass the --run-dir of a training run")
    label = run_dir.name
    config_path = run_dir / "config.json"
    if config_path.is_file():
        precision = json.loads(config_path.read_text()).get("precision")
        label = f"{label} ({precision})" if precision else label
    series = RunSeries(label)
    previous_skipped = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if record.get("event") == "overflow":
            series.skipped_steps.append(int(record["step"]))
            if isinstance(record.get("loss_scale"), (int, float)):
                series.skip_scales[int(record["step"])] = float(record["loss_scale"])
        elif "loss" in record and "step" in record:
            series.steps[int(record["step"])] = record
    if not series.skipped_steps:  # no event records: mark where the skip count rose
        for step, record in sorted(series.steps.items()):
            if record.get("skipped_total", 0) > previous_skipped:
                series.skipped_steps.append(step)
            previous_skipped = record.get("skipped_total", previous_skipped)
    if not series.steps:
        raise UsageError("RUN_DIR", str(run_dir), "metrics.jsonl with at least one logged step",
                         "was the run stopped before its first --log-every step?")
    return series


def _scale_at(series: RunSeries, step: int) -> float | None:
    """The loss scale just after the skip at `step`: its report's, else the next logged one."""
    if step in series.skip_scales:
        return series.skip_scales[step]
    later = [r for s, r in sorted(series.steps.items()) if s >= step and "loss_scale" in r]
    return float(later[0]["loss_scale"]) if later else None


def write_plots(runs: list[RunSeries], out_dir: Path) -> list[Path]:
    """Write the PNGs into `out_dir` (four always, the throughput ones where some run logged
    them); returns their paths."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("matplotlib", "not installed", "matplotlib for plots",
                         "pip install 'ddp_amp[plot]'") from None
    matplotlib.use("Agg")  # files only; no display needed (SLURM nodes, CI)
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    charts = [("loss.png", "loss", "loss", False), ("loss_scale.png", "loss_scale", "loss scale", True),
              ("throughput.png", "samples_per_s", "samples/s", False),
              ("memory.png", "peak_mem_mb", "peak memory (MB)", False)]
    # Logged only where known: tokens for a task that has them, MFU on a GPU with a known peak.
    optional = [("tokens.png", "tokens_per_s", "tokens/s", False),
                ("flops.png", "tflops", "model TFLOP/s per rank", False),
                ("mfu.png", "mfu", "MFU", False)]
    charts += [chart for chart in optional if any(run.column(chart[1])[0] for run in runs)]
    written = []
    for name, key, ylabel, log_axis in charts:
        fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
        try:
            for run in runs:
                steps, values = run.column(key)
                # Dots where there are few points, so a short run's line is still visible.
                line = ax.plot(steps, values, label=run.label, marker="." if len(steps) < 40 else None)[0]
                if key == "loss_scale" and run.skipped_steps:
                    marks = [(s, v) for s in run.skipped_steps if (v := _scale_at(run, s)) is not None]
                    ax.scatter([s for s, _ in marks], [v for _, v in marks], marker="x",
                               color=line.get_color(), label=f"{run.label}: skipped steps")
            if log_axis:
                ax.set_yscale("log", base=2)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(ylabel)
            ax.set_title(ylabel + " vs step")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
            fig.savefig(out_dir / name, dpi=DPI)  # no bbox "tight": the size stays fixed
        finally:
            plt.close(fig)
        written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_amp.report",
                                     description="Plot loss, loss scale, throughput and memory of runs.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the PNGs (default: RUN_DIR/plots of the first run)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = [read_run(run_dir) for run_dir in args.run_dirs]
        written = write_plots(runs, args.out or args.run_dirs[0] / "plots")
    except UsageError as error:
        print(f"ddp_amp.report: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    exit_process(main())
