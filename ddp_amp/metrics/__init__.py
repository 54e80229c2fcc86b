"""What a run tells its user: rank 0's console lines, progress bar and run-directory records.

- `run_log`: `RunLog` (rank 0: console, config.json, metrics.jsonl, summary) and
  `QuietRunLog` (other ranks: warnings only), so no caller writes `if rank == 0`;
- `progress`: the terminal progress bar;
- `throughput`: model FLOPs counted once, tokens/s, MFU against `peaks` (dense peaks of
  known GPUs by exact model, docs/peaks.md), memory in use: the throughput fields of each log line.

Imports `distributed`, `durable` and `errors` from ddp_amp, nothing above; its writes to the run
directory go through `distributed.on_rank_zero`. Plots of a finished run are
the `ddp_amp.report` entry point.
"""

from ddp_amp.metrics.peaks import dense_peak_tflops, dense_peak_tflops_for
from ddp_amp.metrics.run_log import QuietRunLog, RunLog, make_run_log, peak_memory_mb
from ddp_amp.metrics.throughput import can_count_flops, counting_flops, throughput_fields, utilization

__all__ = ["QuietRunLog", "RunLog", "can_count_flops", "counting_flops", "dense_peak_tflops", "dense_peak_tflops_for",
           "make_run_log", "peak_memory_mb", "throughput_fields", "utilization"]
