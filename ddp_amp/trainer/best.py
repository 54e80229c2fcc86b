"""`--keep-best METRIC[:min|max]`: the checkpoint with the best eval metric, and the test pass.

After each evaluation (the cadence's and the final one) the metric is compared with the
best so far; a strictly better value saves a checkpoint at that step, if there is none
yet, and points `checkpoints/best.json` at it (the Checkpointer's `keep_best`), so retention keeps it
beside the last `--keep-last`. The best so far is read back from that pointer on a
resume. Eval metrics are means over all ranks, so every rank takes the same decision and
calls the collective save together. At the end, a task's `test_data` is scored with the
weights of the best checkpoint (or the final ones without `--keep-best`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_amp.option_values import METRIC_GOAL, MetricGoal
from ddp_amp.session import BestRecord, Checkpointer
from ddp_amp.trainer.evaluation import metric_of


class BestKeeper:
    """Decides, after each evaluation, whether this step's checkpoint is the new best."""

    def __init__(self, goal: MetricGoal, checkpointer: Checkpointer, root: Path, info: Callable[[str], None]) -> None:
        self.goal, self.checkpointer, self.root, self.info = goal, checkpointer, root, info
        self.best: BestRecord | None = None
        self.reload()

    def reload(self) -> None:
        """Take the best so far from the run's pointer (after a resume); one for another
        metric or direction does not count."""
        saved = Checkpointer.best(self.root)
        if saved is not None and (saved.metric, saved.mode) == self.goal and saved.directory(self.root).is_dir():
            self.best = saved
        else:
            self.best = None

    def after_eval(self, record: dict[str, Any], save: Callable[[], Path | None]) -> None:
        """Collective (the save): keep this step's checkpoint if `record` beats the best."""
        # Checked at the evaluation before the first step too, so a wrong name stops the run early.
        value = metric_of(record, self.goal.metric, "--keep-best", METRIC_GOAL.text(self.goal), "--keep-best {name}")
        step = record.get("step", 0)
        if step == 0:  # before the first step: nothing trained to keep
            return
        if math.isnan(value) or (self.best is not None and not self.best.beaten_by(value)):
            return
        if save() is None:  # checkpointing off or the write failed: nothing to point at
            return
        best = BestRecord(self.goal.metric, self.goal.mode, value, step)
        self.checkpointer.keep_best(self.root, best)
        self.best = best
        self.info(f"best {self.goal.metric}={value:.6g} so far: checkpoint of step {step} kept (--keep-best)")
