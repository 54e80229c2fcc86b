"""The training loop: a loop over the run core (`Session`), as a user's own loop would be.

One optimizer step is `grad_accum` micro-steps (micro_steps.py): every micro-step but the
last runs forward *and* backward inside `no_sync()`, so DDP reduces gradients once per step,
and each micro-loss is weighed so that the accumulated gradient is the step's over the
global batch (a mean per micro-batch, or a sum over items the task counts, over the step's
count). Then the session's AMP step (unscale, clip, agreed skip, update), and after it, in this
order and for these reasons:
1. the watchdogs (`RunWatch.after_update`) before `zero_grad`: forensics reads the skipped
   step's gradients;
2. `zero_grad(set_to_none=True)`: no memset, and accumulation starts from nothing;
3. the scheduler advances only when the step was taken, so a skip does not eat the LR plan
   (lr_steps.py: without reading the skip flag on every step).
Between steps, the cadences (cadences.py) evaluate, log, save and watch for preemption.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_amp.config import TrainConfig
from ddp_amp.data import make_stream
from ddp_amp.errors import UsageError
from ddp_amp.guards import PreemptionWatch, RunWatch, stop_for_preemption, worker_ignores
from ddp_amp.metrics import RunLog, can_count_flops, counting_flops, peak_memory_mb, throughput_fields
from ddp_amp.session import AgreedGradScaler, Session
from ddp_amp.tasks import Task
from ddp_amp.trainer.batch_loss import BatchLoss
from ddp_amp.trainer.best import BestKeeper
from ddp_amp.trainer.cadences import Cadence, Checkpointing, Evaluation, Logging, Preemption, StepClock
from ddp_amp.trainer.checkpoints import RunCheckpoints
from ddp_amp.trainer.evaluation import evaluate
from ddp_amp.trainer.micro_steps import MicroSteps
from ddp_amp.trainer.optimizers import make_optimizers
from ddp_amp.trainer.profiling import ProfileWindow
from ddp_amp.trainer.resume import TrainingParts, scale_learning_rates
from ddp_amp.trainer.schedules import SchedulerDriver
from ddp_amp.torch_api import compiled_graphs


def build_task_model(session: Session, config: TrainConfig, task: Task, overwritten: Collection[str] = ()) -> nn.Module:
    """`Task.build_model`'s model, on torch seeded by `--seed` (each rank's streams are left as
    they were), drawing no init for the `overwritten` parameters; under --shard each rank
    builds only its shards of it (`Session.build_model`)."""
    if task.build_model is None:
        raise UsageError("Task", task.name or "a task", "a model= or a build_model= function",
                         "return ddp_amp.Task(model=...) or Task(build_model=...)")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.seed)
        return session.build_model(task.build_model, overwritten, task.tensor_parallel_plan)


class Trainer:
    """The task's model, optimizer and data on one rank of a session, and the loop over them."""

    def __init__(self, session: Session, config: TrainConfig, task: Task, run_log: RunLog,
                 checkpoint_root: Path | None = None, overwritten: Collection[str] = ()) -> None:
        self.session, self.config, self.task, self.run_log = session, config, task, run_log
        ctx, self.device = session.ctx, session.device
        parallel, guard, data = config.parallel_options(), config.guard_options(), config.data_options()
        model = task.model if task.model is not None else build_task_model(session, config, task, overwritten)
        self.model = session.setup(model, compile_model=parallel.compile, grad_comm_dtype=parallel.grad_comm_dtype,
                                   units=task.shard_units, tensor_parallel_plan=task.tensor_parallel_plan,
                                   **({"static_graph": True} if parallel.static_graph else {}))
        self.layout = session.describe(self.model)  # what the start line says of the model
        # After setup: sharding replaces each parameter by its shard (a DTensor), which the
        # watchdogs must read.
        named = [(n, p) for n, p in session.unwrap(self.model).named_parameters() if p.requires_grad]
        self.watch = RunWatch(config.watch_options(), named, session.scaler, run_log, ctx.rank, session.precision,
                              distributed=ctx.has_group)
        # --compile compiles a loss_fn on its own as well: a cross-entropy over a large
        # vocabulary then runs as fused kernels instead of materialising fp32 log-probabilities.
        self.micro = MicroSteps(session, self.model, BatchLoss(task, compile_loss=parallel.compile),
                                config.grad_accum, task.count_loss_items)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # A task may make several optimizers (a GAN's two); they step together or not at all,
        # on one agreed skip decision. The first one's LR is logged and scheduled.
        self.optimizers = make_optimizers(task, config.optimizer, self.params, config.lr or task.default_lr,
                                          self.device, config.optimizer_impl)
        self.optimizer = self.optimizers[0]
        self.scheduler = task.make_scheduler(self.optimizer) if task.make_scheduler else None
        self.clip_grad_norm = config.clip_grad_norm or task.default_clip_grad_norm or None
        self.preemption = PreemptionWatch(guard.preempt_signal, self.device, guard.preempt_check_s, ctx.has_group,
                                          stop_signums=guard.stop_signal)
        self.stream = make_stream(task.train_data, task.make_loader, task.schedule_on, ctx,
                                  data.micro_batch_size(ctx.dp_size), data.num_workers, config.seed,
                                  worker_ignores(self.preemption.signums), samples_per_step=config.batch_size)
        self.schedule = SchedulerDriver(self.scheduler, session.scaler, task.schedule_on, self.stream) \
            if self.scheduler else None
        self.checkpoints = RunCheckpoints(
            session, TrainingParts(self.model, tuple(self.optimizers), self.scheduler, self.stream, task.state),
            checkpoint_root, keep_last=config.keep_last, config=config.to_dict(), schedule=self.schedule,
            watch=self.watch, info=run_log.info, data_identity=task.data_identity)
        self.profile = ProfileWindow(config.profile_steps, config.memory_snapshot,
                                     checkpoint_root.parent / "profile" if checkpoint_root is not None else None,
                                     ctx.rank, self.device, run_log.info)
        self.best = BestKeeper(config.keep_best, session.checkpointer, checkpoint_root, run_log.info) \
            if config.keep_best and checkpoint_root is not None else None
        self.step = 0  # optimizer steps attempted; skipped fp16 steps count
        self.samples_seen = 0
        self.flops_per_step: int | None = None  # this rank's model FLOPs per step, once counted
        self._flops_uncounted = can_count_flops(parallel.compile)  # counted on this process's first step
        # --compile: dynamo's graphs so far, before this trainer's first step (None: not compiling)
        self._graphs_before = compiled_graphs() if parallel.compile else None
        self._steps_here = 0  # steps this process ran (a resumed run's first is 1)
        self.last_loss = torch.zeros((), device=self.device)

    # --- one step ---------------------------------------------------------------------

    def train_step(self) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches; returns the loss (device tensor).

        Steady-state steps read nothing from the device (tests/test_host_reads.py): flags,
        counters and losses stay there until a log, check or checkpoint step reads them.
        """
        session = self.session
        step_loss = self.micro.run(self.stream)
        if self.schedule is not None:  # a planned per-step LR goes in place after an exact state
            self.schedule.before_step()
        session.step(*self.optimizers, clip_grad_norm=self.clip_grad_norm, skip_together=True)
        self.watch.after_update(self.step + 1, step_loss)  # before zero_grad: forensics reads the grads
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.schedule is not None:  # per step: on taken steps only, without a host sync per step
            self.schedule.after_step()
        self.step += 1
        self.session.set_step(self.step)  # for the heartbeat, which the failure watch's thread writes
        self.samples_seen += self.config.batch_size
        return step_loss if step_loss.dtype == torch.float32 else step_loss.float()

    def _profiled_step(self) -> torch.Tensor:
        """`train_step` inside the profile window; the first one here counts its model FLOPs
        (its compiled code run eagerly: metrics/throughput.py), and by the second a run that
        compiles has compiled something, or says it has not."""
        self.profile.before_step(self.step)
        try:
            if self._flops_uncounted:
                self._flops_uncounted = False
                loss, self.flops_per_step = counting_flops(self.train_step)
            else:
                loss = self.train_step()
        except torch.OutOfMemoryError:
            self.profile.dump_memory("out of memory")
            raise
        self.profile.after_step(self.step)
        self._steps_here += 1
        if self._steps_here == 2 and self._graphs_before is not None and compiled_graphs() == self._graphs_before:
            self.run_log.warn("--compile: two steps ran and torch.compile made no graph, so the model runs eagerly; "
                              "TORCH_LOGS=graph_breaks,recompiles says why")
        return loss

    # --- the loop ---------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train for `max_steps` steps, with evaluation, logging, checkpoints and the
        preemption check on their cadences; returns the summary record, or the stop record.

        Preemption signals only set a flag while training (guards/preemption.py); the
        previous handlers come back however fit ends, so a failed run still dies on TERM.
        """
        config = self.config
        clock = StepClock(self.step, self.samples_seen)
        evaluation = Evaluation(config.eval_every, self.eval_record, clock)
        cadences: list[Cadence] = [
            evaluation,
            Logging(config.log_every, config.max_steps, self.log_record, self.run_log.metrics, self.watch.on_log,
                    clock, lambda: self.samples_seen),
            Checkpointing(config.ckpt_every, lambda: self.save_checkpoint(background=config.async_checkpoint)),
            Preemption(self.preemption, config.max_steps, self.stop_for_preemption),
        ]
        self.preemption.install(self.step)
        try:
            self.model.train()
            evaluation.before_training(self.step)
            self.run_log.start_progress(config.max_steps, self.step)
            loss = self.last_loss
            while self.step < config.max_steps:
                loss = self._profiled_step()
                self.run_log.advance()
                for cadence in cadences:
                    stop = cadence.after_step(self.step, loss)
                    if stop is not None:
                        return stop
            return self.finish(loss, clock, evaluation.last)
        finally:
            self.preemption.restore()
            self.profile.finish()  # a window training ended inside of (a stop, an error) is written too

    def finish(self, loss: torch.Tensor, clock: StepClock, last_eval: dict[str, Any]) -> dict[str, Any]:
        """After the last step: the final checkpoint and evaluation, the test pass, the summary."""
        self.watch.finish(self.step)
        rate, step_time, elapsed = clock.total(self.step, self.samples_seen)
        if self.schedule is not None:  # the scheduler's state exact at the end, saved or not
            self.schedule.before_checkpoint()
        self.save_checkpoint()  # the final one; a halted run raised before
        summary = self.log_record(loss, rate, step_time)
        if last_eval.get("step") != self.step:  # reuse the cadence's metric at this very step
            last_eval = {"step": self.step, **self.evaluate()}
            if self.best is not None and len(last_eval) > 1:
                self.best.after_eval(last_eval, self.save_checkpoint)
        summary.update({
            "steps": self.step,
            "steps_taken": self.step - summary["skipped_total"],
            "world_size": self.session.world_size,
            "precision": self.session.precision.name,
            "device": str(self.device),
            "wall_s": elapsed,
            "flops_per_step": self.flops_per_step,  # this rank's model FLOPs, counted on the first step
            **{key: value for key, value in last_eval.items() if key != "step"},
        })
        if self.best is not None and self.best.best is not None:
            summary.update(best_metric=self.best.goal.metric, best_value=self.best.best.value,
                           best_step=self.best.best.step)
        summary.update(self.test_record())
        return summary

    def stop_for_preemption(self) -> dict[str, Any]:
        """Checkpoint and requeue after an agreed preemption signal; the stop record (collective)."""
        self.watch.finish(self.step)
        record = stop_for_preemption(lambda: self.checkpoints.save_for_stop(self.step, self.samples_seen),
                                     self.preemption, self.config.preempt_requeue == "auto", self.step, os.environ,
                                     self.run_log.event, self.config.max_requeues)
        if record["checkpoint"] is None and self.checkpoints.error is not None:
            raise self.checkpoints.error  # agreed: the same on every rank
        return record

    # --- records ----------------------------------------------------------------------

    def _mean_across_ranks(self, value: torch.Tensor) -> float:
        """Average a scalar over ranks (collective; called on logging steps only)."""
        total = self.session.all_reduce(value.detach().clone().float())
        return total.item() / self.session.world_size

    def log_record(self, loss: torch.Tensor, samples_per_s: float, step_time: float = 0.0) -> dict[str, Any]:
        """Numbers for one logged step (collective: averages the loss over ranks)."""
        scaler, precision = self.session.scaler, self.session.precision
        return {
            "step": self.step,
            "epoch": self.stream.epoch,
            "loss": self._mean_across_ranks(loss),
            "lr": self.schedule.before_log() if self.schedule else self.optimizer.param_groups[0]["lr"],
            "loss_scale": scaler.get_scale() if scaler.is_enabled() else 1.0,
            "skipped_total": int(scaler.skipped_steps().item()),
            "samples_per_s": samples_per_s,
            "step_time": step_time,
            "peak_mem_mb": peak_memory_mb(self.device),
            **throughput_fields(self.flops_per_step, step_time, samples_per_s, self.task.tokens_per_sample,
                                self.device, precision.matmul_kind(), self.config.peak_tflops or None),
            # --compile: dynamo's graphs so far in this process; growth after the first steps is recompiling.
            **({"compiled_graphs": compiled_graphs()} if self._graphs_before is not None else {}),
            # A step_fn's own scalars, averaged over ranks (the same names on every rank).
            **{name: self._mean_across_ranks(value) for name, value in sorted(self.micro.extras.items())},
        }

    def evaluate(self, data: Any = None, prefix: str = "eval_") -> dict[str, float]:
        """The task's metric on its eval data (or `data`): under autocast, no scaler, all ranks (collective)."""
        return evaluate(self.task, self.session.local_module(self.model), self.model, self.session,
                        self.config.micro_batch_size(self.session.ctx.dp_size), data=data, prefix=prefix,
                        collective_forward=self.session.sharded)

    def eval_record(self) -> dict[str, Any]:
        """`evaluate()` at the current step, logged to metrics.jsonl (collective)."""
        record = {"step": self.step, **self.evaluate()}
        if len(record) > 1:  # a task without eval data or metric logs nothing
            self.run_log.metrics(record)
            if self.schedule is not None:
                self.schedule.after_eval(record)
            if self.best is not None:
                self.best.after_eval(record, self.save_checkpoint)
        return record

    def test_record(self) -> dict[str, Any]:
        """The task's metric on its test data, `test_*`, with the best checkpoint's weights
        where `--keep-best` kept one (collective; after training: it may change the model)."""
        if self.task.test_data is None:
            return {}
        tested = self.step
        if self.best is not None and self.best.best is not None and self.best.best.step != self.step:
            tested = self.best.best.step
            best = self.session.read(self.best.best.directory(self.checkpoints.root))[0]  # type: ignore[arg-type]  # set: best needs a root
            self.session.restore(best, {"model": self.model}, restore_rng=False, notice=self.run_log.info)
        return {**self.evaluate(self.task.test_data, prefix="test_"), "test_weights_from_step": tested}

    # --- checkpoints: what goes in is checkpoints.py's, the layout and protocol the session's ---

    @property
    def scaler(self) -> AgreedGradScaler:
        """The run's loss scaler (the session's)."""
        return self.session.scaler

    def save_checkpoint(self, background: bool = False) -> Path | None:
        """Commit a checkpoint of the current step (collective); see RunCheckpoints.save."""
        return self.checkpoints.save(self.step, self.samples_seen, background=background)

    def load_initial_weights(self, source: str, strict: bool = True) -> None:
        """A fresh run's pretrained weights (`--init-weights`), over the model's init (no
        collective: each rank reads the slices it holds)."""
        loaded = self.session.load_weights(self.model, source, strict)
        left = f", {len(loaded.missing)} left as initialised" if loaded.missing else ""
        ignored = f", {len(loaded.unexpected)} of the files' ignored" if loaded.unexpected else ""
        self.run_log.info(f"initial weights from {source}: {loaded.tensors} tensors, "
                          f"{loaded.bytes_read:,} bytes read on rank {self.session.rank}{left}{ignored}")

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, scaler, scheduler, counters, data position and this
        rank's RNG from checkpoint directory `path` (collective)."""
        restored = self.checkpoints.load(Path(path), optimizer_may_change="optimizer" in self.config.allow_change)
        self.step, self.samples_seen = restored.step, restored.samples_seen
        if restored.optimizer_loaded:
            self._apply_new_lr(restored.meta.config or {})
        if self.schedule is not None:
            self.schedule.after_load()
        self.session.set_step(self.step, checkpoint=path)  # what the watch reports
        self.run_log.info(f"resumed from {path} at step {self.step}")

    def _apply_new_lr(self, saved_config: dict[str, Any]) -> None:
        """A resume with another --lr: the restored optimizer's rates are rescaled to it."""
        saved_lr = float(saved_config.get("lr", 0.0) or self.task.default_lr)
        new_lr = self.config.lr or self.task.default_lr
        if "lr" not in saved_config or saved_lr == new_lr:
            return
        for index, optimizer in enumerate(self.optimizers):  # the scheduler is the first one's
            scale_learning_rates(optimizer, self.scheduler if index == 0 else None, new_lr / saved_lr)
        rates = ", ".join(f"{group['lr']:.6g}" for optimizer in self.optimizers for group in optimizer.param_groups)
        self.run_log.info(f"--lr {new_lr:g} (saved {saved_lr:g}): the optimizer's learning rates are now {rates}")

    def resume(self, choice: str) -> Path | None:
        """Apply `--resume auto|none|PATH` (collective); returns the checkpoint used, if any."""
        root = self.checkpoints.root
        if root is None and choice == "auto":
            return None
        path = self.session.checkpointer.choose(choice, root or Path(choice), self.run_log.warn)
        if path is not None:
            self.load_checkpoint(path)
        if self.best is not None:  # what this run's checkpoints hold now (none after an archive)
            self.best.reload()
        return path
