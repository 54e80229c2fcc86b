"""The training loop: the AMP recipe done right under DDP.

One optimizer step is `grad_accum` micro-steps. Every micro-step but the last runs forward
*and* backward inside `no_sync()`, so DDP reduces gradients once per step; each micro-loss
is divided by `grad_accum` so the accumulated gradient is the mean over the global batch.
Then the one AMP step (`ddp_amp.amp.step`: unscale, clip, agreed skip, update), and after
it, in this order and for these reasons:
1. the watchdogs (`RunWatch.after_update`) before `zero_grad`: forensics reads the skipped
   step's gradients;
2. `zero_grad(set_to_none=True)`: no memset, and accumulation starts from nothing;
3. the scheduler advances only when the step was taken, so a skip does not eat the LR plan
   (lr_steps.py: without reading the skip flag on every step).
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset

from ddp_amp import checkpoint
from ddp_amp.checkpoint import safe_load
from ddp_amp.amp import AutocastModule, Precision, amp_step, scaled_backward, unwrap_model, wrap_model
from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext, all_reduce_, comm_hook, mark_agreed
from ddp_amp.errors import UsageError
from ddp_amp.guards import PreemptionWatch, RunWatch, stop_for_preemption, worker_ignores
from ddp_amp.metrics import RunLog, counting_flops, peak_memory_mb, throughput_fields
from ddp_amp.tasks import Task
from ddp_amp.trainer.checkpointing import MODEL_FILE, TrainingParts, load_training_state, scale_learning_rates
from ddp_amp.trainer.batch_loss import BatchLoss
from ddp_amp.trainer.best import BestKeeper
from ddp_amp.trainer.evaluation import evaluate
from ddp_amp.trainer.saving import CheckpointSaves
from ddp_amp.trainer.schedules import SchedulerDriver
from ddp_amp.trainer.optimizers import make_optimizers
from ddp_amp.trainer.profiling import ProfileWindow, parse_window
from ddp_amp.trainer.iterable_stream import iterable_stream
from ddp_amp.trainer.loader_stream import LoaderStream
from ddp_amp.trainer.stream import BatchStream, collate
from ddp_amp.trainer.task_loader import task_loader_stream

_NOTHING = nullcontext()  # reusable: nullcontext keeps no state
# What log_record writes itself: a step_fn's extra scalars may not take these names.
_RECORD_FIELDS = frozenset({"step", "epoch", "loss", "lr", "loss_scale", "skipped_total", "samples_per_s",
                            "step_time", "peak_mem_mb", "tokens_per_s", "tflops", "mfu", "mem_mb"})


class Trainer(CheckpointSaves):
    """Builds DDP(AutocastModule(model)), optimizer, scaler and data for one rank, and trains."""

    def __init__(self, config: TrainConfig, task: Task, ctx: DistContext, precision: Precision,
                 run_log: RunLog, checkpoint_root: Path | None = None) -> None:
        self.config, self.task, self.ctx, self.precision, self.run_log = config, task, ctx, precision, run_log
        self.device = ctx.device
        self.scaler = precision.make_scaler(**config.loss_scale_options().scaler_kwargs())
        user_model = task.model.to(self.device)
        named = [(n, p) for n, p in user_model.named_parameters() if p.requires_grad]
        self.watch = RunWatch(config.watch_options(), named, self.scaler, run_log, ctx.rank, precision.name,
                              distributed=ctx.has_group)
        # A Python comm hook only where --grad-comm-dtype needs one; else DDP's C++ all-reduce.
        hook = comm_hook(config.grad_comm_dtype, ctx.backend or "gloo") if ctx.has_group else None
        self.model = wrap_model(user_model, precision, self.device, distributed=ctx.has_group,
                                compile_model=config.compile, comm_hook=hook, static_graph=config.static_graph)
        self._ddp = isinstance(self.model, DDP)
        # Without DDP the step calls the wrapped module itself: the step's own autocast region
        # is the one the wrapper would enter, and skipping the wrapper saves a module call.
        self._forward = self.model if self._ddp else self.model.unwrap()
        # --compile compiles a loss_fn on its own as well: a cross-entropy over a large
        # vocabulary then runs as fused kernels instead of materialising fp32 log-probabilities
        # (docs/benchmarks.md, the transformer section).
        self.batch_loss = BatchLoss(task, compile_loss=config.compile)
        self.extras: dict[str, torch.Tensor] = {}  # a step_fn's other scalars, last step, on the device
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # A task may make several optimizers (a GAN's two); they step together or not at all,
        # on one agreed skip decision. The first one's LR is logged and scheduled.
        self.optimizers = make_optimizers(task, config.optimizer, self.params, config.lr or task.default_lr,
                                          self.device, config.optimizer_impl)
        self.optimizer = self.optimizers[0]
        self.scheduler = task.make_scheduler(self.optimizer) if task.make_scheduler else None
        self.clip_grad_norm = config.clip_grad_norm or task.default_clip_grad_norm or None
        requeue_signals, stop_signals = config.signals()
        self.preemption = PreemptionWatch(requeue_signals, self.device, config.preempt_check_s, ctx.has_group,
                                          stop_signums=stop_signals)
        signums = self.preemption.signums
        micro_batch_size = config.micro_batch_size(ctx.world_size)
        if task.make_loader is not None:  # the task's own loader, sharded by the task
            self.stream: BatchStream | LoaderStream = task_loader_stream(
                task.make_loader, task.schedule_on, ctx, self.device, micro_batch_size, config.num_workers,
                config.seed, worker_ignores(signums))
        elif isinstance(task.train_data, IterableDataset):  # a stream: sharded by striding, resumed by replay
            self.stream = iterable_stream(task.train_data, micro_batch_size, ctx.rank, ctx.world_size, self.device,
                                          config.num_workers, collate_fn=collate, worker_init_fn=worker_ignores(signums))
        else:
            self.stream = BatchStream(task.train_data, micro_batch_size, ctx.rank, ctx.world_size, config.seed,
                                      self.device, config.num_workers, worker_init_fn=worker_ignores(signums))
        self.schedule = SchedulerDriver(self.scheduler, self.scaler, task.schedule_on, self.stream) \
            if self.scheduler else None
        self.step = 0  # optimizer steps attempted; skipped fp16 steps count
        self.flops_per_step: int | None = None  # this rank's model FLOPs per step, once counted
        self.samples_seen = 0
        self.last_loss = torch.zeros((), device=self.device)
        # None = checkpointing off (library use without a run dir).
        self.checkpoint_root = checkpoint_root
        self.checkpoint_error: checkpoint.CheckpointError | None = None
        self._saved_step: int | None = None
        self.last_checkpoint: Path | None = None  # the newest this run committed or resumed from
        self.background = checkpoint.BackgroundSaver()  # --async-checkpoint's writer, one save in flight
        if config.keep_best and task.metric is None and task.eval_fn is None:
            raise UsageError("--keep-best", config.keep_best, "a task with eval_data and a metric",
                             "the best checkpoint is chosen by an eval metric; drop --keep-best")
        if config.memory_snapshot and self.device.type != "cuda":
            raise UsageError("--memory-snapshot", True, "a CUDA device (it records the CUDA allocator)",
                             "drop --memory-snapshot on a CPU run")
        self.profile = ProfileWindow(parse_window(config.profile_steps), config.memory_snapshot,
                                     checkpoint_root.parent / "profile" if checkpoint_root is not None else None,
                                     ctx.rank, self.device, run_log.info)
        self.best = BestKeeper(config.keep_best, checkpoint_root, run_log.info) \
            if config.keep_best and checkpoint_root is not None else None

    @property
    def autocast_model(self) -> AutocastModule:
        return self.model.module if isinstance(self.model, DDP) else self.model

    def train_step(self) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches; returns the loss (device tensor).

        Steady-state steps read nothing from the device (tests/test_host_reads.py): flags,
        counters and losses stay there until a log, check or checkpoint step reads them.
        """
        accum = self.config.grad_accum
        step_loss: torch.Tensor | None = None
        for micro in range(accum):
            batch = next(self.stream)
            last = micro == accum - 1
            sync = self.model.no_sync() if not last and self._ddp else _NOTHING
            with sync:
                # Forward and loss in one autocast region, as in the recipe; the wrapper
                # inside DDP sees it is already in effect and does not enter it again.
                with self.precision.autocast():
                    loss, extras = self.batch_loss(self._forward, batch)
                if accum > 1:
                    loss = loss / accum
                scaled_backward(self.scaler, loss)
            detached = loss.detach()
            step_loss = detached if step_loss is None else step_loss + detached
            if extras:
                self._add_extras(extras, first=micro == 0, accum=accum)
        if self.schedule is not None:  # a planned per-step LR goes in place after an exact state
            self.schedule.before_step()
        amp_step(self.scaler, self.optimizers, clip_grad_norm=self.clip_grad_norm, clip_params=self.params,
                 skip_together=True)
        self.watch.after_update(self.step + 1, step_loss)  # before zero_grad: forensics reads the grads
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.schedule is not None:  # per step: on taken steps only, without a host sync per step
            self.schedule.after_step()
        self.step += 1
        self.ctx.progress.step = self.step  # for the heartbeat, which the watch thread writes
        self.samples_seen += self.config.batch_size
        return step_loss.float()  # type: ignore[union-attr]

    def _add_extras(self, extras: dict[str, torch.Tensor], first: bool, accum: int) -> None:
        """Keep a step_fn's scalars as the step's mean over its micro-batches (device ops only)."""
        for name, value in extras.items():
            share = value.float() / accum if accum > 1 else value.float()
            if name in self.extras and not first:
                self.extras[name] = self.extras[name] + share
                continue
            if name not in self.extras and name in _RECORD_FIELDS:
                raise UsageError("Task.step_fn's scalar", name, "a name the log does not use already",
                                 "rename it, e.g. 'train_" + name + "'")
            self.extras[name] = share

    def _mean_across_ranks(self, value: torch.Tensor) -> float:
        """Average a scalar over ranks (collective; called on logging steps only)."""
        total = all_reduce_(value.detach().clone().float())
        return total.item() / self.ctx.world_size

    def log_record(self, loss: torch.Tensor, samples_per_s: float, step_time: float = 0.0) -> dict[str, Any]:
        """Numbers for one logged step (collective: averages the loss over ranks)."""
        return {
            "step": self.step,
            "epoch": self.stream.epoch,
            "loss": self._mean_across_ranks(loss),
            "lr": self.schedule.before_log() if self.schedule else self.optimizer.param_groups[0]["lr"],
            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else 1.0,
            "skipped_total": int(self.scaler.skipped_steps().item()),
            "samples_per_s": samples_per_s,
            "step_time": step_time,
            "peak_mem_mb": peak_memory_mb(self.device),
            **throughput_fields(self.flops_per_step, step_time, samples_per_s, self.task.tokens_per_sample,
                                self.device, self.precision.name),
            # A step_fn's own scalars, averaged over ranks (the same names on every rank).
            **{name: self._mean_across_ranks(value) for name, value in sorted(self.extras.items())},
        }

    def evaluate(self) -> dict[str, float]:
        """The task's metric on its eval data: under autocast, no scaler, all ranks (collective)."""
        return evaluate(self.task, self.autocast_model, self.model, self.ctx,
                        self.config.micro_batch_size(self.ctx.world_size))

    def eval_record(self) -> dict[str, Any]:
        """`evaluate()` at the current step, logged to metrics.jsonl (collective)."""
        record = {"step": self.step, **self.evaluate()}
        if len(record) > 1:  # a task without eval data or metric logs nothing
            self.run_log.metrics(record)
            if self.schedule is not None:
                self.schedule.after_eval(record)
            if self.best is not None:
                self.best.after_eval(record, self._checkpoint_or_raise)
        return record

    def test_record(self) -> dict[str, Any]:
        """The task's metric on its test data, `test_*`, with the best checkpoint's weights
        where `--keep-best` kept one (collective; after training: it may change the model)."""
        if self.task.test_data is None:
            return {}
        tested = self.step
        if self.best is not None and self.best.best is not None and self.best.best.step != self.step:
            tested = self.best.best.step
            state = safe_load(self.best.best.directory(self.checkpoint_root) / MODEL_FILE)  # type: ignore[arg-type]
            unwrap_model(self.model).load_state_dict(state)
        metrics = evaluate(self.task, self.autocast_model, self.model, self.ctx,
                           self.config.micro_batch_size(self.ctx.world_size), data=self.task.test_data, prefix="test_")
        return {**metrics, "test_weights_from_step": tested}

    def fit(self) -> dict[str, Any]:
        """Train for `max_steps` steps, logging every `log_every`; returns the summary record.

        Preemption signals only set a flag while training (see ddp_amp/guards/preemption.py); the
        previous handlers come back however fit ends, so a failed run still dies on TERM.
        """
        self.preemption.install(self.step)
        try:
            return self._fit()
        except BaseException:
            # No collective here: a peer may be gone. Rank 0's background write finishes or
            # fails before the process exits; if it never ends, the commit protocol leaves
            # the previous checkpoint whole.
            self.background.join_locally()
            raise
        finally:
            self.preemption.restore()
            self.profile.finish()  # a window training ended inside of (a stop, an error) is written too

    def _fit(self) -> dict[str, Any]:
        self.model.train()
        started = window_start = time.perf_counter()
        started_step, started_samples = self.step, self.samples_seen  # a resumed run counts from here
        window_samples, window_steps = self.samples_seen, self.step
        loss = self.last_loss
        every = self.config.eval_every
        # Evaluate before the first step too, so the log shows where learning started (not
        # after a resume: the interrupted run logged the metric at that step if it was due).
        last_eval = self.eval_record() if every and self.step == 0 else {}
        self.run_log.start_progress(self.config.max_steps, self.step)
        while self.step < self.config.max_steps:
            self.profile.before_step(self.step)
            try:
                if self.flops_per_step is None:  # the first step here: count its model FLOPs once
                    loss, self.flops_per_step = counting_flops(self.train_step)
                else:
                    loss = self.train_step()
            except torch.OutOfMemoryError:
                self.profile.dump_memory("out of memory")
                raise
            self.profile.after_step(self.step)
            self.run_log.advance()
            if every and self.step % every == 0:
                eval_started = time.perf_counter()
                last_eval = self.eval_record()
                window_start += time.perf_counter() - eval_started  # keep samples_per_s about training
            if self.step % self.config.log_every == 0 or self.step == self.config.max_steps:
                now = time.perf_counter()
                rate = (self.samples_seen - window_samples) / max(now - window_start, 1e-9)
                step_time = (now - window_start) / max(self.step - window_steps, 1)
                record = self.log_record(loss, rate, step_time)
                self.run_log.metrics(record)
                self.watch.on_log(record)
                window_start, window_samples, window_steps = now, self.samples_seen, self.step
            if self.config.ckpt_every and self.step % self.config.ckpt_every == 0:
                self._cadence_checkpoint()
            if self.step < self.config.max_steps and self.preemption.should_stop(self.step):
                return self.stop_for_preemption()
        self.watch.finish(self.step)
        elapsed = time.perf_counter() - started
        self._checkpoint_or_raise()  # the final one; a halted run raised before reaching it
        summary = self.log_record(loss, (self.samples_seen - started_samples) / max(elapsed, 1e-9),
                                  elapsed / max(self.step - started_step, 1))
        skipped = summary["skipped_total"]
        if last_eval.get("step") != self.step:  # reuse the cadence's metric at this very step
            last_eval = {"step": self.step, **self.evaluate()}
            if self.best is not None and len(last_eval) > 1:
                self.best.after_eval(last_eval, self._checkpoint_or_raise)
        summary.update({
            "steps": self.step,
            "steps_taken": self.step - skipped,
            "world_size": self.ctx.world_size,
            "precision": self.precision.name,
            "device": str(self.device),
            "wall_s": elapsed,
            "flops_per_step": self.flops_per_step,  # this rank's model FLOPs, counted on the first step
            **{key: value for key, value in last_eval.items() if key != "step"},
        })
        if self.best is not None and self.best.best is not None:
            summary.update(best_metric=self.best.metric, best_value=self.best.best.value,
                           best_step=self.best.best.step)
        summary.update(self.test_record())
        return summary

    def stop_for_preemption(self) -> dict[str, Any]:
        """Checkpoint and requeue after an agreed preemption signal; the stop record (collective)."""
        self.watch.finish(self.step)
        record = stop_for_preemption(self.save_checkpoint, self.preemption, self.config.preempt_requeue == "auto",
                                     self.step, os.environ, self.run_log.event, self.config.max_requeues)
        if record["checkpoint"] is None and self.checkpoint_error is not None:
            raise mark_agreed(self.checkpoint_error, 0)  # the same SaveResult on every rank
        return record

    # --- checkpoints: the files are trainer/checkpointing.py's, the protocol ddp_amp.checkpoint's ---

    def _parts(self) -> TrainingParts:
        return TrainingParts(unwrap_model(self.model), self.optimizers, self.scaler, self.scheduler,
                             self.stream, self.device, self.task.state)

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, scaler, scheduler, counters, data position and this
        rank's RNG from checkpoint directory `path` (collective)."""
        restored = load_training_state(Path(path), self._parts(), self.ctx.rank, self.ctx.world_size,
                                       self.precision.name, self.run_log.info,
                                       optimizer_may_change="optimizer" in self.config.allowed_changes())
        self.step, self.samples_seen = restored.step, restored.samples_seen
        if restored.optimizer_loaded:
            self._apply_new_lr(restored.meta.get("config", {}))
        if self.schedule is not None:
            self.schedule.after_load()
        # Saving this step again would only rewrite what is there; elsewhere (another run's
        # checkpoint) it must still be written into this run's directory.
        own = self.checkpoint_root and Path(path).resolve() == (
            self.checkpoint_root / checkpoint.step_dir_name(self.step)).resolve()
        self._saved_step = self.step if own else None
        self.last_checkpoint = Path(path)
        self.ctx.progress.step, self.ctx.progress.checkpoint = self.step, str(path)
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
        if self.checkpoint_root is None and choice == "auto":
            return None
        root = self.checkpoint_root or Path(choice)
        path = checkpoint.choose_checkpoint(choice, root, self.run_log.warn)
        if path is not None:
            self.load_checkpoint(path)
        if self.best is not None:  # what this run's checkpoints hold now (none after an archive)
            self.best.reload()
        return path
