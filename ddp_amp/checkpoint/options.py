"""The checkpoint options of a run: how often to save, what to keep, where to resume from."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.errors import UsageError
from ddp_amp.option_values import INT_LIMIT, METRIC_GOAL, ComponentOptions, MetricGoal, check_fields, option


@dataclass(frozen=True)
class CheckpointOptions(ComponentOptions):
    """Saving cadence, retention, the best checkpoint, and the checkpoint a launch starts from."""

    ckpt_every: int = option(0, "also save a checkpoint every N optimizer steps; 0 = only the "
                             "final one at the end of training", limits=(0, INT_LIMIT))
    keep_last: int = option(3, "keep the newest K checkpoints; older ones are deleted only after "
                            "a new one is committed; 0 keeps all", limits=(0, 2**31))
    resume: str = option("auto", "auto (newest complete checkpoint in <run-dir>/checkpoints, if "
                         "any), none (a fresh run: refused where checkpoints exist, unless "
                         "--archive-checkpoints), or PATH of a checkpoint directory", resume="free", launch=True)
    keep_best: MetricGoal | None = option(None, "METRIC[:min|max]: also keep the checkpoint with the best value "
                                          "of an eval metric (e.g. eval_nll, or eval_accuracy:max; min by default), "
                                          "saved at the evaluation that finds it; retention never deletes it; the "
                                          "task's test data, if any, is scored with it at the end", kind=METRIC_GOAL)
    archive_checkpoints: bool = option(False, "with --resume none: move the run directory's checkpoints "
                                       "to checkpoints-archived-<time>/ before the first step", resume="free",
                                       launch=True)
    init_weights: str = option("", "PATH: start a fresh run from pretrained weights, by name: a .safetensors "
                               "file or a Hugging Face model directory (model.safetensors, or an index and several "
                               "files); each rank reads only the slices it holds under --shard. A resume takes "
                               "its checkpoint's weights instead", resume="free")
    init_weights_strict: bool = option(True, "with --init-weights: refuse a model name the files lack, or a file "
                                       "name the model lacks (--no-init-weights-strict loads what matches and "
                                       "keeps the init of the rest)", resume="free")
    async_checkpoint: bool = option(False, "write the --ckpt-every checkpoints in the background: training "
                                    "waits only for a host copy of the state, rank 0 writes it while the next "
                                    "steps run (one save in flight; the final, preemption and --keep-best saves "
                                    "stay synchronous)", resume="free")

    def check(self) -> None:
        """Ranges, and the options that need another one with them."""
        check_fields(self, CheckpointOptions)
        if self.async_checkpoint and not self.ckpt_every:
            raise UsageError("--async-checkpoint", True,
                             "--ckpt-every N with it (the saves it moves to the background)",
                             "the final checkpoint is always written before the run ends; add e.g. --ckpt-every 500")
        if self.archive_checkpoints and self.resume != "none":
            raise UsageError("--archive-checkpoints", True, "--resume none with it",
                             "it moves old checkpoints aside for a fresh run: add --resume none")
