"""`Session`: DDP + AMP for a training loop you write yourself.

    with Session(precision="fp16") as session:      # plain python, torchrun or srun
        model = session.setup(MyModel())             # DDP(AutocastModule(model)) on the device
        optimizer = torch.optim.AdamW(model.parameters())
        for inputs, target in batches:
            with session.autocast():
                loss = loss_fn(model(session.to_device(inputs)), session.to_device(target))
            session.backward(loss)                   # on the scaled loss
            session.step(optimizer, clip_grad_norm=1.0)  # unscale, clip, agreed skip, update
            optimizer.zero_grad(set_to_none=True)

It is the run core, and the Trainer is a loop over it: `detect_env` -> `init_distributed`
-> `resolve_precision` -> `parallelize` + `AgreedGradScaler` -> the AMP step (`amp_step`) ->
checkpoints (its `Checkpointer`). A failure watch ends this rank when a peer fails.
Leaving the block always leaves the process group, after releasing the DDP wrappers it made
(docs/facts.md: tearing gloo down under a live DDP reducer can abort the process).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ddp_amp.amp import (AgreedGradScaler, AutocastModule, LossScaleOptions, Precision, StepResult, amp_step,
                         scaled_backward, unwrap_model)
from ddp_amp.distributed import (BackendChoice, DeviceChoice, DistContext, Liveness, PeerWatch, agreed_origin,
                                 all_gather_objects, all_reduce_, announce_failure, init_distributed, on_rank_zero,
                                 shutdown_distributed, to_device)
from ddp_amp.env import detect_env
from ddp_amp.errors import UsageError
from ddp_amp.guards import check_rank_sync
from ddp_amp.hf import LoadedWeights, load_pretrained
from ddp_amp.metrics.trackers import Trackers, start_trackers_on_rank_zero
from ddp_amp.checkpoint import Checkpointer
from ddp_amp.parallel import ShardOptions, Units, fused_kernel_takes
from ddp_amp.torch_api import loss_parallel
from ddp_amp.session.choices import KEYWORDS, layout_shard, resolve_choices
from ddp_amp.session.models import SessionModels
from ddp_amp.session.preemption import LoopPreemption, Signals
from ddp_amp.session.place import SessionPlace
from ddp_amp.session.saving import SessionSaving

log = logging.getLogger(__name__)
T = TypeVar("T")


class Session(SessionPlace, SessionSaving):
    """Launch environment, process group, precision and loss scaler for one process.

    `precision`: auto, fp32, bf16, fp16 or fp8, or torch's name of the dtype (`"float16"`,
    `torch.bfloat16`); `device`: auto, cpu, cuda (the GPU of the local rank) or one GPU
    (`"cuda:1"`, a `torch.device`)."""

    option_names: ClassVar[Mapping[str, str]] = KEYWORDS  # how refusals name the options (choices.py)

    def __init__(self, precision: str | torch.dtype = "auto", device: DeviceChoice = "auto",
                 backend: BackendChoice = "auto", timeout_s: float = 600.0,
                 scaler_options: Mapping[str, float | int] | None = None,
                 environ: Mapping[str, str] | None = None, *, fp8_emulate: bool = False,
                 shard: ShardOptions | None = None, save_arrival_s: float = 30.0,
                 liveness: Liveness | None = None, tensor_parallel: int = 1, context_parallel: int = 1) -> None:
        if not save_arrival_s > 0:
            raise UsageError("save_arrival_s", save_arrival_s, "seconds > 0", "e.g. 30")
        self.save_arrival_s = save_arrival_s
        self._choices = (precision, device, backend, timeout_s, fp8_emulate)
        # The amp layer's defaults, as the CLI's --loss-scale-* have them (a floor included);
        # the caller's settings replace them one by one.
        self._scaler_options = {**LossScaleOptions().scaler_kwargs(), **(scaler_options or {})}
        self._environ = environ
        self._shard = shard
        self._tensor_parallel, self._context_parallel = tensor_parallel, context_parallel
        self._liveness = liveness
        self._ctx: DistContext | None = None
        self._precision: Precision | None = None
        self._scaler: AgreedGradScaler | None = None
        self._checkpoints: Checkpointer | None = None
        self._models: SessionModels | None = None
        self._owns_group = False
        self._watch: PeerWatch | None = None

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Session:
        """Detect the launcher and join the process group (collective)."""
        return self.start()

    def start(self) -> Session:
        """What entering the `with` block does, for a caller that ends it with `close()`."""
        if self._ctx is not None:
            raise UsageError("Session", "already started", "a session not yet started",
                             "do not nest `with` blocks of one Session")
        precision, device, backend, timeout_s, fp8_emulate = self._choices
        env = detect_env(os.environ if self._environ is None else self._environ)
        # Refused, where they are, before any group is joined; a split model is spread over the
        # data-parallel ranks by FSDP2, sharded or (without shard=) replicated.
        self._shard = layout_shard(self._shard, self._tensor_parallel, env, self.option_names, self._context_parallel)
        chosen, self._precision = resolve_choices(precision, device, backend, env, fp8_emulate, self._shard,
                                                  self.option_names, self._tensor_parallel)
        # A group the caller made before is the caller's to destroy; one we make is ours.
        owns_group = not dist.is_initialized()
        ctx = init_distributed(env, chosen, backend, timeout_s, group_of_one=self._shard is not None,
                               liveness=self._liveness, replicate=self._shard.replicate if self._shard else 1,
                               host_collectives=self._shard is not None and self._shard.cpu_offload,
                               tensor_parallel=self._tensor_parallel, context_parallel=self._context_parallel)
        try:
            self._scaler = self._precision.make_scaler(**self._scaler_options)
        except Exception:
            if owns_group:
                shutdown_distributed()
            raise
        self._owns_group = owns_group
        self._ctx = ctx
        self._models = SessionModels(ctx, self._precision, self._shard, self.option_names)
        self._checkpoints = Checkpointer(ctx, self._precision, self._scaler, log.warning)
        # A peer whose exception leaves its session block ends this process too (failure.py),
        # and so do a silent peer and a launcher that is gone (watch.py).
        limits = ctx.liveness
        self._watch = PeerWatch(ctx.store, ctx.env, ctx.progress, limits.poll_s, limits.silence_s,
                                limits.beats_per_s).start()
        log.debug("session: rank %d/%d on %s, %s (%s)", ctx.rank, ctx.world_size, ctx.device,
                  self._precision.name, self._precision.reason)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Leave the group; an exception of this rank alone ends the other ranks within seconds.

        Its peers would otherwise wait in their next collective until the timeout: the
        failure is published in the group's store, where their watch threads find it. The
        traceback is printed first (a launcher may stop this process as soon as a peer
        ends), and not again if the exception reaches the top of the program.
        """
        ctx = self._ctx
        if isinstance(exc, Exception) and agreed_origin(exc) is None and ctx is not None:
            self.explain(exc)  # a peer killed or hung: named in one line, and this process ends
            announce_failure(exc, ctx.store, ctx.rank)
        try:
            if exc is None and self._checkpoints is not None and self._checkpoints.in_flight is not None:
                self.wait_for_save()  # a background save's failure is the block's: raised here
        finally:
            self.close()

    def explain(self, error: BaseException, show_error: bool = False) -> None:
        """After a collective failed: a peer killed or hung, or a launcher gone, is named in one
        line for the job and this process ends (the watch); otherwise this returns."""
        if self._watch is not None:
            self._watch.explain(error, show_error=show_error)

    def close(self) -> None:
        """Leave the process group the session joined, after releasing its DDP wrappers.

        A background save still being written is let finish (or fail) first, without
        talking to the other ranks. A group that existed before the session is left alone,
        and so are its models.
        """
        if self._ctx is None:
            return
        if self._checkpoints is not None:
            self._checkpoints.join_locally()
        self._ctx = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        models, self._models = self._models, None
        if not self._owns_group:
            return
        gc.collect()
        if models is not None:
            models.release()
        shutdown_distributed()

    # -- where this process is: SessionPlace's ctx, env, rank, local_rank, world_size, is_main, device --

    @property
    def precision(self) -> Precision:
        self.ctx  # noqa: B018 - raises when not started
        return self._precision  # type: ignore[return-value]  # set while ctx is

    @property
    def scaler(self) -> AgreedGradScaler:
        """The one loss scaler of this process (disabled, a pass-through, unless fp16)."""
        self.ctx  # noqa: B018 - raises when not started
        return self._scaler  # type: ignore[return-value]  # set while ctx is

    def set_step(self, step: int, *, checkpoint: str | os.PathLike[str] | None = None) -> None:
        """Tell the session the step this rank finished (and, optionally, the run's newest
        checkpoint): a peer's line about this rank going silent or making no progress names
        them, and the preemption record is of that step. Local and cheap: call it every step."""
        progress = self.ctx.progress  # read by the watch's thread: plain attributes, set whole
        progress.step = step
        if checkpoint is not None:
            progress.checkpoint = str(checkpoint)

    def preemption(self, signals: Signals = "USR1", stop_signals: Signals = "TERM", *, check_every_s: float = 2.0,
                   requeue: bool = True, max_requeues: int = 20, run_dir: str | os.PathLike[str] | None = None,
                   start_step: int = 0) -> LoopPreemption:
        """The Trainer's preemption stop for this loop (see `ddp_amp.session.preemption`): a
        `signals` one (SLURM's `--signal=USR1@120`) saves and requeues, a `stop_signals` one
        saves and stops. `run_dir` gets the records in metrics.jsonl; `start_step` is a
        resumed loop's first step. Enter it around the loop."""
        environ = os.environ if self._environ is None else self._environ
        return LoopPreemption(self.ctx, self.set_step, environ, signals=signals, stop_signals=stop_signals,
                              check_every_s=check_every_s, requeue=requeue, max_requeues=max_requeues,
                              run_dir=Path(run_dir) if run_dir is not None else None, start_step=start_step)

    # -- models ----------------------------------------------------------------------

    def setup(self, model: nn.Module, *, compile_model: bool = False, grad_comm_dtype: str = "fp32",
              cast_outputs_to_fp32: bool = False, units: Units = None,
              tensor_parallel_plan: Mapping[str, str] | None = None, **ddp_options: Any) -> nn.Module:
        """Move `model` to the device and wrap it (collective): DDP(AutocastModule(model)), the AutocastModule
        alone for a world of one, or with `shard` `AutocastModule(model)` sharded (FSDP2: `units`, module classes
        or a function naming its blocks, else its largest ModuleList's children, then the model). `compile_model`
        compiles it inside the wrapper (sharded: each unit's forward); `grad_comm_dtype` ("bf16", "fp16") reduces
        gradients compressed. With `tensor_parallel=` the model's matmuls are split first, by
        `tensor_parallel_plan` (module name patterns -> styles) or a transformers model's own plan; with
        `context_parallel=` its attention layers gather each sequence (a transformers model's). Make optimizers
        from the returned module's parameters. Other keywords (static_graph, ...) go to DDP."""
        return self._made().setup(model, compile_model=compile_model, grad_comm_dtype=grad_comm_dtype,
                                  cast_outputs_to_fp32=cast_outputs_to_fp32, units=units, ddp_options=ddp_options,
                                  tensor_parallel_plan=tensor_parallel_plan)

    def build_model(self, factory: Callable[[], nn.Module], overwritten: Collection[str] = (),
                    tensor_parallel_plan: Mapping[str, str] | None = None) -> nn.Module:
        """`factory()` for `setup`, drawing no init for the `overwritten` names (weights loaded next:
        `load_weights`); sharding, each rank builds only its shards' rows, equal to a plain build's
        from rank 0's stream, never the whole model (collective; docs/sharding.md). Split
        (tensor_parallel=), by `tensor_parallel_plan` or the model's own: each rank's part of the split."""
        return self._made().build(factory, overwritten, tensor_parallel_plan)

    def load_weights(self, model: nn.Module, source: str | os.PathLike[str], strict: bool = True) -> LoadedWeights:
        """A set-up model's weights from a .safetensors file or a Hugging Face model directory, by name,
        each rank reading only what it holds; strict about names and shapes (one-line UsageError)."""
        return load_pretrained(unwrap_model(model), Path(source), strict)

    def describe(self, model: nn.Module) -> str:
        """What `setup` applied to `model`: 'replicated', or 'sharded: 2 x Block and the model as the root'."""
        return self._made().describe(model)

    # Whether an optimizer's fused kernel takes a set-up model's parameters (sharded or not).
    fused_kernel_takes = staticmethod(fused_kernel_takes)

    def local_module(self, model: nn.Module) -> AutocastModule:
        """The AutocastModule inside a set-up model: same weights, no DDP collectives. For eval
        and inference: its forward autocasts (in any thread); replicated, it never talks to other
        ranks, so ranks may run different numbers of batches. Sharded, every forward gathers
        weights from every rank: all ranks must run the same number."""
        return self._made().local_module(model)

    @property
    def sharded(self) -> bool:
        """Whether this session shards its models (every forward is then collective)."""
        return self._shard is not None

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The user's own module inside DDP and AutocastModule."""
        return unwrap_model(model)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """No gradient reduction for micro-batches before the last of a step (DDP's or FSDP's)."""
        return self._made().no_sync(model)

    def autocast(self) -> AbstractContextManager[Any]:
        """Autocast in the run's precision, this thread only: for losses and eval code."""
        return self.precision.autocast()

    def loss_parallel(self) -> AbstractContextManager[Any]:
        """Where the model is split (tensor_parallel=), its logits come split over the vocabulary: enter
        this around the loss and its backward, which then run on the parts; elsewhere it does nothing."""
        return loss_parallel() if self.ctx.tp_size > 1 else nullcontext()

    # -- gradients and steps ---------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (the loss itself unless fp16)."""
        return self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor, **backward_options: Any) -> None:
        """Backward of the scaled loss; keywords (retain_graph, inputs) go to `backward`.

        Collective through a DDP model (its gradient all-reduce), except inside `no_sync`.
        A `retain_graph=True` backward while a DDP model of this session syncs gradients is
        refused: DDP reduces gradients in one backward per forward (it arms the reduction in
        the forward), so a second backward through the same graph would leave each rank its
        own unreduced gradients and the replicas would drift apart.
        """
        if backward_options.get("retain_graph") and self._made().synced_ddp():
            raise UsageError("retain_graph", True, "one backward per forward through a DDP model",
                             "DDP reduces the gradients of the first backward only; sum the losses and call "
                             "session.backward(loss0 + loss1) once: the gradients are the same")
        scaled_backward(self.scaler, loss, **backward_options)

    def unscaled_grad(self, loss: torch.Tensor, inputs: Sequence[torch.Tensor],
                      create_graph: bool = True) -> tuple[torch.Tensor, ...]:
        """`torch.autograd.grad` of `loss` for a gradient penalty, in real units.

        Differentiates the *scaled* loss, so fp16 gradients do not underflow, then divides
        by the scale. With `create_graph` the result can enter a loss for `backward`; an
        inf here makes that loss inf and the step is skipped, as it should be. Not
        collective: DDP reduces gradients only in the final `backward`.
        """
        grads = torch.autograd.grad(self.scaler.scale(loss), list(inputs), create_graph=create_graph)
        if not self.scaler.is_enabled():
            return tuple(grads)
        scale = self.scaler._get_scale_async()  # the device tensor: dividing by it reads nothing
        if scale is None:  # scale() above made it
            raise RuntimeError("the loss scaler has no scale after scaling the loss")
        return tuple(grad / scale for grad in grads)

    def step(self, *optimizers: torch.optim.Optimizer, clip_grad_norm: float | None = None,
             clip_params: Iterable[torch.Tensor] | None = None, update: bool = True,
             skip_together: bool = False) -> StepResult:
        """Unscale, clip, step each optimizer unless any rank saw inf/NaN, update once (collective).

        Clipping uses one total norm over all given optimizers' gradients, in real units;
        `clip_params` (e.g. `model.parameters()`) names the parameters to clip, in the order
        torch's `clip_grad_norm_` would be given them, so a loop clips as a plain one does.
        Each optimizer skips on an inf in its own gradients, as torch's GradScaler does;
        `skip_together` makes them step together or not at all (a GAN's two, say). Pass
        several optimizers that share the scaler in one call, or use `update=False` for all
        but the last call of a step: the scale must change once per step.
        """
        if not optimizers:
            raise UsageError("optimizers", "none", "at least one optimizer", "session.step(optimizer)")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise UsageError("clip_grad_norm", clip_grad_norm, "a number > 0 or None",
                             "None turns clipping off")
        return amp_step(self.scaler, optimizers, clip_grad_norm=clip_grad_norm, clip_params=clip_params,
                        update=update, skip_together=skip_together)

    def update(self) -> None:
        """Update the loss scale once, after every optimizer of the step has stepped."""
        self.scaler.update()

    def check_sync(self, model: nn.Module, step: int = 0) -> None:
        """Stop if the ranks no longer hold the same weights and scaler state (collective).

        The Trainer's `--check-sync-every` guard: a fingerprint of the model's parameters, the
        scaler's state and `step` is gathered; where any rank differs from rank 0, every rank
        raises `TrainingHalted` naming the ranks and parameters. Call it on every rank alike.
        """
        named = [(name, p) for name, p in unwrap_model(model).named_parameters() if p.requires_grad]
        check_rank_sync(named, self.scaler, step)

    # -- data and collectives --------------------------------------------------------

    def to_device(self, batch: Any) -> Any:
        """Move tensors (also inside lists, tuples and dicts) to this rank's device."""
        return to_device(batch, self.device)

    def split_sequences(self, batch: Any) -> Any:
        """Under context_parallel=, this rank's part of each sequence (tensors of 2+ dims cut on dim 1)."""
        sequences = self._made().sequences
        return batch if sequences is None else sequences.keep(batch)

    def on_rank_zero(self, work: Callable[[], T]) -> T:
        """Rank 0 runs `work`; every rank returns its result or raises its error (collective)."""
        self.ctx  # noqa: B018 - raises when not started
        return on_rank_zero(work)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place, and returned (collective)."""
        self.ctx  # noqa: B018 - raises when not started
        return all_reduce_(tensor)

    def all_gather_objects(self, obj: object) -> list[object]:
        """Every rank's picklable object, in rank order (collective)."""
        self.ctx  # noqa: B018 - raises when not started
        return all_gather_objects(obj)

    def trackers(self, specs: Sequence[str], run_dir: str | os.PathLike[str], config: Mapping[str, Any] | None = None,
                 start_step: int = 0) -> Trackers:
        """Experiment trackers for the run in `run_dir`, as `--tracker` starts them (rank 0's
        log, the others' do nothing; `start_step` > 0 continues the runs `run_dir` recorded).
        Collective: one that fails to start raises on every rank. Call `finish()` at the end."""
        self.ctx  # noqa: B018 - raises when not started
        return start_trackers_on_rank_zero(list(specs), Path(run_dir), dict(config or {}), start_step, log.warning)

    @property
    def checkpointer(self) -> Checkpointer:
        """The session's `Checkpointer` (its save, find, read and restore; collectives)."""
        self.ctx  # noqa: B018 - raises when not started
        return self._checkpoints  # type: ignore[return-value]  # set while ctx is

    def _made(self) -> SessionModels:
        self.ctx  # noqa: B018 - raises when not started
        return self._models  # type: ignore[return-value]  # set while ctx is
