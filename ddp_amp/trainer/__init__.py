"""The training loop behind `python -m ddp_amp.train`: a loop over the run core, usable from a script too.

    with session_for(config) as session:
        summary = build_trainer(session, config).fit()

- `loop`: `Trainer` (steps, micro-steps, the loop and its summary);
- `cadences`: what runs between steps (evaluation, logging, checkpoints, the preemption stop);
- `build`: the one way to build it (`build_trainer`, `prepare_task`, `seed_everything`);
- `options`: the run's options taken apart into each component's (`session_for`, ...);
- `batch_loss`: how a micro-batch becomes a loss (loss_fn, the task's step_fn, or the model's own);
- `best`: `--keep-best`'s checkpoint by an eval metric, and the test pass;
- `schedules`: when the task's LR scheduler steps (each taken step, each epoch, or after each
  evaluation with a metric); `lr_steps`: the per-step cadence, on taken steps only, without a
  host sync per step;
- `evaluation`: the task's metric, exact over any number of ranks;
- `optimizers`: the task's optimizer(s), or AdamW / SGD with the fastest kernels;
- `checkpoints`: what the Trainer saves and when; `resume`: what must fit to take it back;
- `profiling`: `--profile-steps` and `--memory-snapshot`;
- `run_dir` and `resume_plan`: the run's directory and lock, and where a launch starts.

Imports every layer below it; nothing below imports it.
"""

from ddp_amp.trainer.build import build_trainer, prepare_task, seed_everything
from ddp_amp.trainer.loop import Trainer
from ddp_amp.trainer.optimizers import make_optimizer, make_optimizers
from ddp_amp.trainer.options import session_for

__all__ = ["Trainer", "build_trainer", "make_optimizer", "make_optimizers", "prepare_task", "seed_everything",
           "session_for"]
