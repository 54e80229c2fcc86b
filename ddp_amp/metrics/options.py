"""The logging options of a run: how often rank 0 records, where else records go, and the
peak a throughput's MFU is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.option_values import INT_LIMIT, NAMES, ComponentOptions, check_fields, option


@dataclass(frozen=True)
class LogOptions(ComponentOptions):
    """The run log's cadence, its trackers, and the device's peak for MFU."""

    log_every: int = option(20, "print and record metrics every N optimizer steps", limits=(1, INT_LIMIT))
    tracker: tuple[str, ...] = option((), "experiment trackers that also get every record, comma-separated: "
                                      "tensorboard, wandb (offline unless WANDB_MODE says otherwise), mlflow, or "
                                      "package.module:function returning your own; rank 0 only; a resume continues "
                                      "their runs", resume="free", kind=NAMES)
    peak_tflops: float = option(0.0, "the device's dense peak TFLOP/s for the run's precision, for the log's MFU "
                                "(0: from the table of known GPUs, docs/peaks.md; a GPU not in it, or a CPU, gets "
                                "no MFU)", resume="free", limits=(0, 1e7))

    def check(self) -> None:
        """Choices and ranges."""
        check_fields(self, LogOptions)
