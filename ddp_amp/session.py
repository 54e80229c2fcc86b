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
-> `wrap_model` + `AgreedGradScaler` -> the AMP step (`amp_step`, the Trainer's too) ->
checkpoints (`ddp_amp.checkpoint`, the Trainer's commit protocol). Leaving the block always
leaves the process group, after releasing the DDP wrappers it made (docs/facts.md: tearing
gloo down under a live DDP reducer can abort the process).
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp import checkpoint
from ddp_amp.amp import (AgreedGradScaler, AutocastModule, Precision, StepResult, amp_step, resolve_precision,
                         scaled_backward, unwrap_model, wrap_model)
from ddp_amp.distributed import (BackendChoice, DeviceChoice, DistContext, PeerWatch, agreed_origin,
                          all_gather_objects, announce_failure, init_distributed, mark_agreed, on_rank_zero,
                          release_ddp, shutdown_distributed, to_device)
from ddp_amp.env import DistEnv, detect_env
from ddp_amp.errors import UsageError
from ddp_amp.guards import check_rank_sync
from ddp_amp.metrics.trackers import Trackers, start_trackers_on_rank_zero

log = logging.getLogger(__name__)

# A Session checkpoint is a directory: the user's state in `state.pt` (the loss scaler's
# state under the reserved key below), plus every checkpoint's `rng.pt` and `meta.json`.
STATE_FILE = "state.pt"
SCALER_KEY = "scaler"


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
        self._watch: PeerWatch | None = None

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
        # A peer whose exception leaves its session block ends this process too (failure.py),
        # and so do a silent peer and a launcher that is gone (watch.py).
        self._watch = PeerWatch(ctx.store, ctx.env, ctx.progress).start()
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
            if self._watch is not None:
                self._watch.explain(exc)  # a peer killed or hung: named in one line, and this process ends
            announce_failure(exc, ctx.store, ctx.rank)
        self.close()

    def close(self) -> None:
        """Leave the process group the session joined, after releasing its DDP wrappers.

        A group that existed before the session is left alone, and so are its models.
        """
        if self._ctx is None:
            return
        self._ctx = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        refs, self._ddp_refs = self._ddp_refs, []
        if not self._owns_group:
            return
        gc.collect()
        for ref in refs:
            model = ref()
            if model is not None:
                release_ddp(model)
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
        wrapped = wrap_model(model, precision, ctx.device, distributed=ctx.has_group,
                             cast_outputs_to_fp32=cast_outputs_to_fp32,
                             find_unused_parameters=find_unused_parameters,
                             gradient_as_bucket_view=gradient_as_bucket_view, **ddp_options)
        if isinstance(wrapped, DDP):
            self._ddp_refs.append(weakref.ref(wrapped))
        return wrapped

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
        A `retain_graph=True` backward while a DDP model of this session syncs gradients is
        refused: DDP reduces gradients in one backward per forward (it arms the reduction in
        the forward), so a second backward through the same graph would leave each rank its
        own unreduced gradients and the replicas would drift apart.
        """
        if backward_options.get("retain_graph") and self._synced_ddp_models():
            raise UsageError("retain_graph", True, "one backward per forward through a DDP model",
                             "DDP reduces the gradients of the first backward only; sum the losses and call "
                             "session.backward(loss0 + loss1) once: the gradients are the same")
        scaled_backward(self.scaler, loss, **backward_options)

    def _synced_ddp_models(self) -> list[DDP]:
        models = (ref() for ref in self._ddp_refs)
        return [m for m in models if m is not None and m.require_backward_grad_sync]

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
        return tuple(grad / scale for grad in grads)

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
        return amp_step(self.scaler, optimizers, clip_grad_norm=clip_grad_norm, update=update)

    def update(self) -> None:
        """Update the loss scale once, after every optimizer of the step has stepped."""
        self.scaler.update()

    def check_sync(self, model: nn.Module, step: int = 0) -> None:
        """Stop if the ranks no longer hold the same weights and scaler state (collective).

        The Trainer's `--check-sync-every` guard: every rank gathers a fingerprint of the
        model's parameters, the scaler's state and `step`; if any rank differs from rank 0,
        every rank raises `TrainingHalted` naming the ranks and the parameters that differ.
        Call it on every rank at the same point, e.g. every few hundred steps.
        """
        named = [(name, p) for name, p in unwrap_model(model).named_parameters() if p.requires_grad]
        check_rank_sync(named, self.scaler, step)

    # -- data and collectives --------------------------------------------------------

    def to_device(self, batch: Any) -> Any:
        """Move tensors (also inside lists, tuples and dicts) to this rank's device."""
        return to_device(batch, self.device)

    def all_gather_objects(self, obj: object) -> list[object]:
        """Every rank's picklable object, in rank order (collective)."""
        self.ctx  # noqa: B018 - raises when not started
        return all_gather_objects(obj)

    def trackers(self, specs: Sequence[str], run_dir: str | os.PathLike[str], config: Mapping[str, Any] | None = None,
                 start_step: int = 0) -> Trackers:
        """Experiment trackers (`"tensorboard"`, `"wandb"`, `"mlflow"`, `"package.module:function"`)
        for the run in `run_dir`, as `--tracker` starts them: rank 0's log what `log(record, step)`
        gets, the other ranks' do nothing; `start_step` > 0 continues the tracker runs recorded
        in `run_dir` (a resume). Call `finish()` at the end (collective: a tracker that fails to
        start raises on every rank)."""
        self.ctx  # noqa: B018 - raises when not started
        return start_trackers_on_rank_zero(list(specs), Path(run_dir), dict(config or {}), start_step, log.warning)

    # -- checkpoints: the Trainer's commit protocol, manifest and RNG states -------------

    def save(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
        """Save a checkpoint directory at `path`; rank 0 commits it atomically (collective).

        `state` maps names to models (saved unwrapped, without `module.` prefixes),
        optimizers, anything with `state_dict`, and plain values (numbers, strings, paths,
        numpy values, containers of them). The loss scaler and every rank's RNG state are
        saved too. A directory already at `path` is replaced only if it is a checkpoint,
        and only once the new one is complete. Returns the path on every rank.
        """
        self.ctx  # noqa: B018 - raises when not started
        if SCALER_KEY in state:
            raise UsageError("state key", SCALER_KEY, "a key other than the reserved one",
                             "the session saves its scaler under it; rename yours")
        payload = {key: _state_of(value) for key, value in state.items()}
        payload[SCALER_KEY] = self.scaler.state_dict()
        meta = {"saved_by": "ddp_amp.Session", "precision": self.precision.name,
                "loss_scaling": self.scaler.is_enabled(),
                "scaler_skipped_total": int(self.scaler.skipped_steps().item())}
        result = checkpoint.save_directory(Path(path), {STATE_FILE: payload}, meta, self.device,
                                           self.world_size)
        if result.error is not None:
            raise mark_agreed(result.error, 0)  # the same outcome on every rank
        return Path(path)

    def load(self, path: str | os.PathLike[str], state: Mapping[str, Any], *,
             restore_rng: bool = True) -> dict[str, Any]:
        """Load a `save` checkpoint into the given objects and the scaler; return its state.

        Collective. Every rank reads the directory (it must be on a filesystem every rank
        sees) and checks it holds every key asked for; any rank's refusal is raised on
        every rank before anything is loaded. Rank 0's scaler state is authoritative and
        every rank verifies it agrees. With `restore_rng` each rank gets back the RNG
        streams it saved, so a resumed loop draws what an uninterrupted one would.
        """
        ctx = self.ctx
        target = on_rank_zero(lambda: _find_checkpoint(Path(path)))  # one rank hashes the files, as a resume does

        def holds_keys(loaded: checkpoint.LoadedCheckpoint) -> dict[str, Any]:
            payload = loaded.files[STATE_FILE]
            for key in state:
                if key not in payload:
                    raise UsageError("checkpoint key", key, f"one of {sorted(payload)}",
                                     "save it first, or leave it out of the load")
            return payload

        loaded, payload = checkpoint.read_agreed(target, (STATE_FILE,), holds_keys, what="checkpoint")
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                unwrap_model(obj).load_state_dict(payload[key])
            elif hasattr(obj, "load_state_dict"):
                obj.load_state_dict(payload[key])
        checkpoint.restore_scaler(self.scaler, payload.get(SCALER_KEY) or {},
                                  int(loaded.meta.get("scaler_skipped_total", 0)), self.precision.name,
                                  str(loaded.meta.get("precision")), log.info)
        if restore_rng:
            checkpoint.restore_own_rng(loaded, ctx.rank, ctx.device)
        return payload


def _state_of(value: Any) -> Any:
    if isinstance(value, nn.Module):
        return unwrap_model(value).state_dict()  # no `module.` prefixes from the wrappers
    if hasattr(value, "state_dict"):
        return value.state_dict()
    return value


def _find_checkpoint(path: Path) -> Path:
    """`path`, or the complete copy a crash during a re-save left beside it; else UsageError."""
    found = checkpoint.complete_copy(path, log.warning)
    if found is not None:
        return found
    if path.exists():
        raise UsageError("checkpoint", str(path), "a complete checkpoint directory written by Session.save",
                         "it could not be read (no valid manifest.json); it may be torn or not a checkpoint")
    raise UsageError("checkpoint", str(path), "an existing checkpoint directory",
                     "check the path; Session.save writes it")
