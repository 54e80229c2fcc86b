"""Train with DDP + AMP, whatever launched this process.

    python -m ddp_amp.train                                   # 1 process: GPU, else CPU
    torchrun --standalone --nproc_per_node=4 -m ddp_amp.train --precision bf16
    srun --ntasks-per-node=4 python -m ddp_amp.train          # inside an allocation
    python -m ddp_amp.train --help                            # every option
    python -m ddp_amp.train --config run.toml --lr 1e-3       # options from a file; flags win
    python -m ddp_amp.train --config run.toml --print-config  # the resolved options, as TOML

Exit codes: 0 done; 1 a failure (a rank's error, a safety stop); 2 bad input (one line on
stderr; --debug adds the traceback); 3 a checkpoint could not be written (older ones are
kept); 75 stopped by a requeue signal with the checkpoint committed (requeued under SLURM);
128 + N stopped by stop signal N (143 for TERM: scancel) with the checkpoint committed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from ddp_amp.fast_exit import exit_process
from ddp_amp.startup_signals import EarlySignals

# Before the imports below (torch's takes seconds): a SLURM warning can land this early, and
# would end the process. The options' own signals take over in main() once they are read.
_STARTUP = EarlySignals((signal.SIGUSR1, signal.SIGTERM)) if __name__ == "__main__" else None

from torch import nn

from ddp_amp.checkpoint import checkpoint_root, ensure_writable, list_step_dirs
from ddp_amp.command_line import config_toml, parse_command_line
from ddp_amp.config import TrainConfig
from ddp_amp.distributed import agreed_origin, on_every_rank, publish_failure
from ddp_amp.env import detect_env
from ddp_amp.errors import CheckpointError, StoreUnreached, TrainingHalted, UsageError
from ddp_amp.guards import exit_code_for
from ddp_amp.hf import HF_CONFIG, HF_FILES, WeightHeaders, hf_config_record, match_weights, read_headers
from ddp_amp.metrics import RunLog, make_run_log
from ddp_amp.parallel import meta_model
from ddp_amp.session import Session
from ddp_amp.tasks import Task
from ddp_amp.trainer import build_trainer, prepare_task
from ddp_amp.trainer.options import check_options, session_for
from ddp_amp.trainer.resume_plan import ResumePlan, plan_resume
from ddp_amp.trainer.run_dir import lock_run_directory, run_directory


def train(config: TrainConfig, session: Session) -> dict[str, Any]:
    """Build everything for this rank of `session`, train, and return the summary (collective).

    Everything that can fail on the user's input is checked before anything is written:
    options, precision (the session's start), task, batch geometry, an explicit `--resume
    PATH` and its settings; then rank 0 locks the run directory and the start is planned
    under the lock. Everything built here (DDP model, optimizer, reducer hooks) is freed
    when this function returns, before the session leaves the process group (docs/facts.md:
    a gloo group torn down under a live DDP reducer can abort the process).
    """
    run_dir = run_directory(config, session)
    start = config.checkpoint_options()
    # A resume takes its checkpoint's weights: the pretrained files may be gone by then.
    pretrained = start.init_weights if start.init_weights and _starts_fresh(config, run_dir) else ""
    # Its files are read first: a missing or truncated one is refused before the task reads its data.
    headers = on_every_rank(lambda: read_headers(pretrained)) if pretrained else None
    filled: list[frozenset[str]] = [frozenset()]

    def check_weights(task: Task) -> frozenset[str]:
        if headers is not None:
            filled[0] = check_initial_weights(task, headers, start.init_weights_strict)
        return filled[0]

    # A task that fails to build on some ranks only fails on every rank, with its message.
    task = on_every_rank(lambda: prepare_task(config, session, check_weights if pretrained else None))
    data = task.data_identity  # a resume whose data changed is refused (--allow-change data)
    explicit = plan_resume(config, run_dir, session, data) if config.resume not in ("auto", "none") else None
    lock = lock_run_directory(run_dir, session)  # a second job on this directory stops here
    try:
        plan = explicit or plan_resume(config, run_dir, session, data)
        return _train_in(run_dir, plan, config, session, task, filled[0] if plan.checkpoint is None else frozenset())
    finally:
        lock.release()


def check_initial_weights(task: Task, headers: WeightHeaders, strict: bool) -> frozenset[str]:
    """The names of the task's model that `--init-weights` fills, from the files' `headers` and
    the model's names and shapes (its factory run on the meta device: nothing built or drawn),
    before anything is built or written; a one-line UsageError for a name or a shape. Empty
    where the factory cannot build on the meta device (the load checks the same, after the build)."""
    model = task.model if task.model is not None else meta_model(task.build_model) if task.build_model else None
    return match_weights(model, headers, strict).filled if model is not None else frozenset()


def _train_in(run_dir: Path, plan: ResumePlan, config: TrainConfig, session: Session, task: Task,
              filled: frozenset[str]) -> dict[str, Any]:
    """`filled`: the parameters `--init-weights` fills (none on a resume), whose init the build skips."""
    ctx, precision = session.ctx, session.precision
    ckpt_root = checkpoint_root(run_dir)
    ensure_writable(ckpt_root, run_dir)  # all ranks fail together, before any work
    run_log = make_run_log(ctx.rank, run_dir)
    try:
        trainer = build_trainer(session, config, run_log, task=task, checkpoint_root=ckpt_root, overwritten=filled)
        if plan.checkpoint is not None:  # its last checks (shapes, optimizer) before any write
            trainer.load_checkpoint(plan.checkpoint)
        elif config.checkpoint_options().init_weights:  # a fresh start from pretrained weights
            start = config.checkpoint_options()
            on_every_rank(lambda: trainer.load_initial_weights(start.init_weights, start.init_weights_strict))
            if filled:
                run_log.info(f"the build drew no init for the {len(filled)} parameter names the weights fill")
        run_log.info(f"task={task.name} world_size={ctx.world_size} device={ctx.device} "
                     f"backend={ctx.backend or 'none'} precision={precision.name} ({precision.reason}) "
                     f"model={trainer.layout} run_dir={run_dir} start: {plan.describe()}")
        for notice in plan.notices:
            run_log.info(notice)
        run_log.write_json("config.json", {"config": config.to_dict(), "env": vars(ctx.env),
                                           "device": str(ctx.device), "backend": ctx.backend,
                                           "precision": precision.name, "model": trainer.layout})
        _record_hf_config(run_log, session.unwrap(trainer.model))
        if task.hf_files:  # a tokenizer's files, for export --hf to write beside the weights
            run_log.copy_files(HF_FILES, list(task.hf_files))
        # Records past the step we start from belong to a lost attempt: drop them, so a
        # requeued run neither duplicates nor misses steps. A fresh start drops them all
        # (its step-0 records, such as the first evaluation, are written again).
        run_log.rewind_to(trainer.step if plan.checkpoint is not None else -1)
        # The trackers continue their runs from here on a resume (tensorboard drops what a lost
        # attempt logged past this step, as rewind_to did); one that fails to start stops the run.
        run_log.start_trackers(list(config.tracker), config.to_dict(),
                               trainer.step if plan.checkpoint is not None else 0)
        if plan.checkpoint is not None:
            trainer.watch.after_resume(trainer.step)  # ranks must agree right after a load
        summary = trainer.fit()
        if not summary.get("preempted"):  # summary.json means "finished"; a stop is not
            run_log.summary(summary)
        return summary
    finally:
        run_log.close()


def _starts_fresh(config: TrainConfig, run_dir: Path) -> bool:
    """Whether this launch will start from step 0 (no checkpoint to resume from), as far as
    can be told before the run directory is locked."""
    return config.resume == "none" or (config.resume == "auto" and not list_step_dirs(checkpoint_root(run_dir)))


def _record_hf_config(run_log: RunLog, model: nn.Module) -> None:
    """A transformers model's config, for `export --hf` to write as the model directory's config.json."""
    recorded = hf_config_record(model)
    if recorded is not None:
        run_log.write_json(HF_CONFIG, recorded)


def main(argv: list[str] | None = None, exiting: bool = False) -> int:
    """Train as the command line says; the exit code. `exiting`: the process ends right after
    (`python -m ddp_amp.train`), so late preemption signals are ignored once the run is over;
    a caller that goes on (a test, a notebook) keeps its own signal handling."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    rank = 0
    early: EarlySignals | None = None
    try:
        rank = detect_env(os.environ).rank
        command = parse_command_line(argv)
        config = command.config
        check_options(config)
        if command.print_config:  # before any process group or file: it only shows the config
            if rank == 0:
                print(config_toml(config), end="")
            return 0
        debug = debug or config.debug  # `debug = true` in a --config file
        early = EarlySignals(config.preempt_signal + config.stop_signal)  # until the loop's own watch takes over
        if _STARTUP is not None:
            _STARTUP.restore()  # what the options do not name goes back to its default
        # Joins the group and resolves the precision: a refusal there is the same on every rank.
        session = session_for(config).start()
    except UsageError as error:
        if early is not None:
            early.restore()
        if debug:
            raise
        # Every rank read the same input: one line is enough, rank 0's; but a rank that never
        # reached the store whose host is rank 0 cannot count on rank 0 being there to say it.
        if rank == 0 or isinstance(error, StoreUnreached):
            print(f"ddp_amp: error: {error}", file=sys.stderr)
        return 2
    try:
        summary = train(config, session)
        return exit_code_for(summary) if summary.get("preempted") else 0
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # noqa: BLE001 - one line, once, the traceback on --debug
        return _report(error, session, debug)
    finally:
        session.close()
        if exiting:  # nothing is left to save: a late warning must not kill the exit
            early.ignore_from_now()
        else:
            early.restore()


def _report(error: Exception, session: Session, debug: bool) -> int:
    """Print a failure once for the whole job; the exit code for it.

    An error every rank raised together (an agreed one, or a safety stop) is printed by rank
    0. Any other is published for the peers, whose watch then ends them, and printed here,
    unless another rank's failure was published first: then it is the same refusal raised on
    several ranks, or this one is its consequence (a peer vanished mid-collective), and the
    line was shown there.
    A collective that failed because a peer was killed or hung, or the launcher is gone, is
    the watch's to explain: it says so in one line for the job and ends the process.
    """
    ctx = session.ctx
    code = 2 if isinstance(error, UsageError) else 3 if isinstance(error, CheckpointError) else 1
    origin = 0 if isinstance(error, TrainingHalted) else agreed_origin(error)
    if origin is not None:  # raised on every rank together: rank 0 prints it
        if debug:
            raise error
        if ctx.rank == 0:
            print(_failure_line(error, origin), file=sys.stderr, flush=True)
        return code
    session.explain(error, show_error=debug)  # returns where no peer went silent and the launcher is there
    line = _failure_line(error, ctx.rank)
    first = publish_failure(ctx.store, ctx.rank, line)  # the peers' watches end them; one rank prints
    if debug:
        raise error
    if first:
        print(line, file=sys.stderr, flush=True)
    return code


def _failure_line(error: Exception, origin: int) -> str:
    where = f" (on rank {origin})" if origin else ""
    if isinstance(error, UsageError):
        return f"ddp_amp: error: {error}{where}"
    if isinstance(error, TrainingHalted):
        return f"ddp_amp: stopped: {error}"
    if isinstance(error, CheckpointError):
        return f"ddp_amp: checkpoint failed: {error}"
    return (f"ddp_amp: rank {origin}: {type(error).__name__}: {error} (rerun with --debug for the "
            "traceback)")


if __name__ == "__main__":
    exit_process(main(exiting=True))
