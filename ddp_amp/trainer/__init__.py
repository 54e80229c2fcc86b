"""The training loop behind `python -m ddp_amp.train`, usable from a script too.

    trainer = build_trainer(TrainConfig(task="mlp", max_steps=100), ctx)
    summary = trainer.fit()

- `loop`: `Trainer` (steps, micro-steps, logging, evaluation and checkpoint cadence);
- `build`: the one way to build it (`build_trainer`, `prepare_task`, `seed_everything`);
- `stream`: the resumable per-rank stream of micro-batches;
- `batch_loss`: how a micro-batch becomes a loss (loss_fn, the task's step_fn, or the model's own);
- `best`: `--keep-best`'s checkpoint by an eval metric, and the test pass;
- `schedules`: when the task's LR scheduler steps (each taken step, each epoch, or after each
  evaluation with a metric); `lr_steps`: the per-step cadence, on taken steps only, without a
  host sync per step;
- `evaluation`: the task's metric, exact over any number of ranks;
- `optimizers`: the task's optimizer(s), or AdamW / SGD with the fastest kernels;
- `checkpointing`: what the Trainer puts into a checkpoint and takes back out.

Imports every layer below it; nothing below imports it.
"""

from ddp_amp.trainer.build import build_trainer, prepare_task, seed_everything
from ddp_amp.trainer.loop import Trainer
from ddp_amp.trainer.optimizers import make_optimizer, make_optimizers

__all__ = ["Trainer", "build_trainer", "make_optimizer", "make_optimizers", "prepare_task", "seed_everything"]
