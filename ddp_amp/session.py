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

It is a thin shell over the layers: `detect_env` -> `init_distributed` -> `resolve_precision`
-> `AutocastModule` + `AgreedGradScaler`. Leaving the block always leaves the process group,
after releasing the DDP wrappers it made (FACTS.md: tearing gloo down under a live DDP
reducer can abort the process).
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp import interim_checkpoint
from ddp_amp.autocast import AutocastModule, unwrap_model
from ddp_amp.data import to_device
from ddp_amp.dist import (BackendChoice, DeviceChoice, DistContext, all_gather_objects,
                          init_distributed, shutdown_distributed)
from ddp_amp.env import DistEnv, detect_env
from ddp_amp.errors import UsageError
from ddp_amp.precision import Precision, resolve_precision
from ddp_amp.scaler import AgreedGradScaler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What `Session.step` did. Tensors stay on the device; read them at logging time."""

    # 0-d int: 1 if the step was skipped (inf/NaN on any rank). None with update=False.
    skipped: torch.Tensor | None
    # Total norm of the unscaled gradients before clipping. None without clipping.
    grad_norm: torch.Tensor | None


class Session:
    """Launch environment, process group, precision and loss scaler for one process."""

    def __init__(self, precision: str = "auto", device: DeviceChoice = "auto",
                 backend: BackendChoice = "auto", timeout_s: float = 600.0,
                 scaler_options: Mapping[str, float | int] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self._choices = (precision, device, backend, timeout_s)
        self._scaler_options = dict(scaler_options or {})
        self._environ = environ
        self._ctx: DistContext | None = None
        self._precision: Precision | None = None
        self._scaler: AgreedGradScaler | None = None
        self._ddp_refs: list[weakref.ref[DDP]] = []
        self._owns_group = False

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Session:
        """Detect the launcher and join the process group (collective)."""
        if self._ctx is not None:
            raise UsageError("Session", "already started", "a session not yet started",
                             "do not nest `with` blocks of one Session")
        precision, device, backend, timeout_s = self._choices
        env = detect_env(os.environ if self._environ is None else self._environ)
        # A group the caller made before is the caller's to destroy; one we make is ours.
        owns_group = not dist.is_initialized()
        ctx = init_distributed(env, device, backend, timeout_s)
        try:
            self._precision = resolve_precision(precision, ctx.device)
            self._scaler = self._precision.make_scaler(**self._scaler_options)
        except Exception:
            if owns_group:
                shutdown_distributed()
            raise
        self._owns_group = owns_group
        self._ctx = ctx
        log.debug("session: rank %d/%d on %s, %s (%s)", ctx.rank, ctx.world_size, ctx.device,
                  self._precision.name, self._precision.reason)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Leave the process group the session joined, after releasing its DDP wrappers.

        A group that existed before the session is left alone, and so are its models.
        """
        if self._ctx is None:
            return
        self._ctx = None
        refs, self._ddp_refs = self._ddp_refs, []
        if not self._owns_group:
            return
        gc.collect()
        for ref in refs:
            model = ref()
            if model is not None:
                _release_ddp(model)
        shutdown_distributed()

    # -- where this process is -----------------------------------------------------------

    @property
    def ctx(self) -> DistContext:
        if self._ctx is None:
            raise UsageError("Session", "not started", "a started session",
                             "use it inside `with Session(...) as session:`")
        return self._ctx

    @property
    def env(self) -> DistEnv:
        return self.ctx.env

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def local_rank(self) -> int:
        return self.ctx.env.local_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def precision(self) -> Precision:
        self.ctx  # noqa: B018 - raises when not started
        return self._precision  # type: ignore[return-value]

    @property
    def scaler(self) -> AgreedGradScaler:
        """The one loss scaler of this process (disabled, a pass-through, unless fp16)."""
        self.ctx  # noqa: B018 - raises when not started
        return self._scaler  # type: ignore[return-value]

    # -- models ----------------------------------------------------------------------

    def setup(self, model: nn.Module, *, find_unused_parameters: bool = False,
              cast_outputs_to_fp32: bool = False, gradient_as_bucket_view: bool = True,
              **ddp_options: Any) -> nn.Module:
        """Move `model` to the device and wrap it: DDP(AutocastModule(model)) (collective).

        A world of one gets the AutocastModule alone. Make optimizers from the returned
        module's parameters (they are the model's own). Extra keywords go to DDP.
        """
        if isinstance(model, (DDP, AutocastModule)):
            raise UsageError("model", type(model).__name__, "the plain user module",
                             "pass the model before wrapping; setup adds AutocastModule and DDP")
        precision, ctx = self.precision, self.ctx
        wrapped = AutocastModule(model.to(ctx.device), precision.device_type, precision.dtype,
                                 enabled=precision.autocast_enabled,
                                 cast_outputs_to_fp32=cast_outputs_to_fp32)
        if not ctx.has_group:
            return wrapped
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DDP(wrapped, device_ids=device_ids, find_unused_parameters=find_unused_parameters,
                  gradient_as_bucket_view=gradient_as_bucket_view, **ddp_options)
        self._ddp_refs.append(weakref.ref(ddp))
        return ddp

    def local_module(self, model: nn.Module) -> AutocastModule:
        """The AutocastModule inside a set-up model: same weights, no DDP collectives.

        For eval and inference: its forward autocasts (in any thread) but never talks to
        other ranks, so ranks may run different numbers of batches.
        """
        inner = model.module if isinstance(model, DDP) else model
        if not isinstance(inner, AutocastModule):
            raise UsageError("model", type(model).__name__, "a model returned by Session.setup",
                             "pass what session.setup(model) returned")
        return inner

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The user's own module inside DDP and AutocastModule."""
        return unwrap_model(model)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Skip DDP's gradient all-reduce for micro-batches before the last of a step."""
        return model.no_sync() if isinstance(model, DDP) else nullcontext()

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast in the run's precision, this thread only: for losses and eval code."""
        with self.precision.autocast():
            yield

    # -- gradients and steps ---------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (the loss itself unless fp16)."""
        return self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor, **backward_options: Any) -> None:
        """Backward of the scaled loss; keywords (retain_graph, inputs) go to `backward`.

        Collective through a DDP model (its gradient all-reduce), except inside `no_sync`.
        """
        self.scaler.scale(loss).backward(**backward_options)

    def unscaled_grad(self, loss: torch.Tensor, inputs: Sequence[torch.Tensor],
                      create_graph: bool = True) -> tuple[torch.Tensor, ...]:
        """`torch.autograd.grad` of `loss` for a gradient penalty, in real units.

        Differentiates the *scaled* loss, so fp16 gradients do not underflow, then divides
        by the scale. With `create_graph` the result can enter a loss for `backward`; an
        inf here makes that loss inf and the step is skipped, as it should be. Not
        collective: DDP reduces gradients only in the final `backward`.
        """
        grads = torch.autograd.grad(self.scaler.scale(loss), list(inputs), create_graph=create_graph)
        inv_scale = 1.0 / self.scaler.get_scale()
        return tuple(grad * inv_scale for grad in grads)

    def step(self, *optimizers: torch.optim.Optimizer, clip_grad_norm: float | None = None,
             update: bool = True) -> StepResult:
        """Unscale, clip, step each optimizer unless any rank saw inf/NaN, update once (collective).

        Clipping uses one total norm over all given optimizers' gradients, in real units.
        Pass several optimizers that share the scaler in one call, or use `update=False`
        for all but the last call of a step: the scale must change once per step.
        """
        if not optimizers:
            raise UsageError("optimizers", "none", "at least one optimizer", "session.step(optimizer)")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise UsageError("clip_grad_norm", clip_grad_norm, "a number > 0 or None",
                             "None turns clipping off")
        scaler, grad_norm = self.scaler, None
        if clip_grad_norm is not None:
            # Unscale first: the threshold is in real gradient units. The agreed scaler
            # also settles the skip decision across ranks here.
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
            params = [p for optimizer in optimizers for group in optimizer.param_groups
                      for p in group["params"] if p.grad is not None]
            grad_norm = nn.utils.clip_grad_norm_(params, clip_grad_norm)
        for optimizer in optimizers:
            scaler.step(optimizer)
        if not update:
            return StepResult(None, grad_norm)
        scaler.update()
        return StepResult(scaler.last_step_skipped(), grad_norm)

    def update(self) -> None:
        """Update the loss scale once, after every optimizer of the step has stepped."""
        self.scaler.update()

    # -- data and collectives --------------------------------------------------------

    def to_device(self, batch: Any) -> Any:
        """Move tensors (also inside lists, tuples and dicts) to this rank's device."""
        return to_device(batch, self.device)

    def all_gather_objects(self, obj: object) -> list[object]:
        """Every rank's picklable object, in rank order (collective)."""
        self.ctx  # noqa: B018 - raises when not started
        return all_gather_objects(obj)

    # -- checkpoints (interim single-file format, see interim_checkpoint) -------------

    def save(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
        """Save models (unwrapped), optimizers, anything with `state_dict`, plain values
        and the scaler into one file; rank 0 writes it atomically (collective)."""
        self.ctx  # noqa: B018 - raises when not started
        interim_checkpoint.save(path, state, self.scaler, self.is_main)

    def load(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> dict[str, Any]:
        """Load a `save` file into the given objects and the scaler; return the whole file.

        Every rank reads the same file, so all replicas (and scalers) agree afterwards.
        """
        return interim_checkpoint.load(path, state, self.scaler, self.device)


def _release_ddp(model: DDP) -> None:
    """Drop a still-referenced DDP wrapper's hold on the process group before it goes.

    The reducer and its logger keep the group alive; destroyed later (at interpreter exit)
    gloo's destructor can abort or hang the process. The wrapper is unusable afterwards,
    as any DDP model is once its group is gone.
    """
    for name in ("logger", "reducer", "process_group"):
        model.__dict__.pop(name, None)
    gc.collect()
