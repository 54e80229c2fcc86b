"""What a session makes of a model, and what it remembers of the models it made.

`setup` builds one `ParallelPlan` from its arguments and the session's `ShardOptions`, and
`parallelize` applies it: replicated, `DDP(AutocastModule(model))` (the AutocastModule alone
for a world of one); or sharded (FSDP2), `AutocastModule(model)` with the model's blocks and
then the model itself sharded in place, after every rank took rank 0's weights (`same_start`).
Either way the user's own module is inside (`unwrap`), with the same parameters.

The session remembers its DDP wrappers (released before the group is torn down; a
`retain_graph` backward through one that syncs is refused), its sharded models (whose
state and optimizer state a checkpoint writes sharded), and what was applied to each model
(`describe`, for a run's start line).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_amp.amp import AutocastModule, Precision, unwrap_model
from ddp_amp.distributed import DistContext
from ddp_amp.errors import UsageError
from ddp_amp.distributed import is_sharded
from ddp_amp.hf import model_tensor_parallel_plan
from ddp_amp.parallel import (ParallelPlan, SequenceSplit, ShardOptions, ShardSlot, TensorParallelPlan, Units,
                              build_sharded, build_whole, check_plan, is_built_sharded, meta_model, parallelize,
                              release_ddp, shard_slot, split_attention, split_dims, split_slot)
from ddp_amp.session.own_stream import OwnStreamReplay
from ddp_amp.session.same_start import broadcast_from_rank_zero

# DDP's keywords that are fields of the plan; the rest pass through as `ddp_options`.
_PLAN_DDP_FIELDS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")


class SessionModels:
    """The models one session set up: how each was wrapped, and what to do with them later."""

    def __init__(self, ctx: DistContext, precision: Precision, shard: ShardOptions | None,
                 names: Mapping[str, str]) -> None:
        self.ctx, self.precision, self.shard, self.names = ctx, precision, shard, names
        self._ddp: list[weakref.ref[DDP]] = []
        self.sharded: list[nn.Module] = []  # the user's modules, sharded (FSDP roots)
        self._described: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        # Each sequence's part this rank keeps, where the mesh splits sequences (context parallel)
        self.sequences = (SequenceSplit(ctx.cp_size, ctx.mesh.get_local_rank("cp"), ctx.mesh.get_group("cp"))
                          if ctx.cp_size > 1 and ctx.mesh is not None else None)

    def setup(self, model: nn.Module, *, compile_model: bool, grad_comm_dtype: str, cast_outputs_to_fp32: bool,
              units: Units, ddp_options: dict[str, Any],
              tensor_parallel_plan: Mapping[str, str] | None = None) -> nn.Module:
        """Move `model` to the device and wrap it (collective); see `Session.setup`."""
        if isinstance(model, (DDP, AutocastModule)):
            raise UsageError("model", type(model).__name__, "the plain user module",
                             "pass the model before wrapping; setup adds AutocastModule and DDP")
        plan = self.plan(compile_model=compile_model, grad_comm_dtype=grad_comm_dtype,
                         cast_outputs_to_fp32=cast_outputs_to_fp32, units=units, ddp_options=ddp_options,
                         tensor_parallel=self.tensor_parallel_plan(model, tensor_parallel_plan))
        if self.sequences is not None:
            split_attention(model, self.sequences, self.names["context_parallel"])
        if plan.shard and self.ctx.world_size > 1 and not is_built_sharded(model):
            # As DDP does at construction: rank 0's init everywhere, whatever each rank seeded.
            broadcast_from_rank_zero(model.to(self.ctx.device))
        made = parallelize(model, plan, self.precision, self.ctx)
        if isinstance(made.model, DDP):
            self._ddp.append(weakref.ref(made.model))
        if plan.shard:
            self.sharded.append(unwrap_model(made.model))
        self._described[made.model] = made.description
        return made.model

    def build(self, factory: Callable[[], nn.Module], overwritten: Collection[str] = (),
              tensor_parallel_plan: Mapping[str, str] | None = None) -> nn.Module:
        """`factory()`, or under sharding each rank's shards of it only (collective; see `Session.build_model`)."""
        if self.shard is None or self.ctx.mesh is None:
            return build_whole(factory, overwritten)
        slots, named = None, None
        if self.ctx.tp_size > 1:
            split = self._split_slots(factory, tensor_parallel_plan)
            if split is None:  # init code that cannot run on the meta device: built whole, then split
                return build_whole(factory, overwritten)
            slots, named = split
        own = torch.get_rng_state()
        first = [own]
        if self.ctx.world_size > 1:
            # Rank 0's stream everywhere, as the rank-0 broadcast of a plain build gives: every
            # rank's rows then come from one model. (An object broadcast works on NCCL too.)
            dist.broadcast_object_list(first, src=0)
        skipped = frozenset(overwritten)
        if torch.equal(own, first[0]):
            return build_sharded(factory, self._slot(), skipped, slots, named)
        # Seeded apart (dropout, data order): this rank's own stream goes on from where a
        # plain build would leave it (own_stream.py), for the draws the build makes.
        torch.set_rng_state(first[0])
        replay = OwnStreamReplay(own)
        try:
            with replay:
                model = build_sharded(factory, self._slot(), skipped, slots, named)
        finally:
            torch.set_rng_state(replay.own)
        return model

    def _slot(self) -> ShardSlot:
        """This rank's slot among the ranks FSDP2 shards over (the session shards: it has a mesh)."""
        return shard_slot(self.ctx.spread_mesh)  # type: ignore[arg-type]  # a sharding session's mesh is laid out

    def _split_slots(self, factory: Callable[[], nn.Module], given: Mapping[str, str] | None
                     ) -> tuple[list[ShardSlot], dict[str, ShardSlot]] | None:
        """Where each parameter of a split model lies on this rank, by registration and by name:
        the plan, checked on the model built on the meta device (before any real build), says
        along which dimension each is split before FSDP2 shards its rows. A registration on a
        module the model does not keep (a layer `nn.TransformerEncoder` copies) is held whole
        until the build ends, its copies cut then; one on a module the model keeps but whose
        parameter it replaced (a head's own weight, before it is tied to the embedding) is
        cut as small as a split parameter's (its values end up nowhere). None where the
        factory cannot build on the meta device."""
        registered: list[nn.Parameter] = []
        owners: list[nn.Module] = []
        meta = meta_model(factory, registered, owners)
        if meta is None or self.ctx.mesh is None:
            return None
        plan = self.tensor_parallel_plan(meta, given)
        dims = split_dims(meta, plan) if plan is not None else {}
        base, mesh = self._slot(), self.ctx.mesh
        named = {name: split_slot(base, mesh, dim) for name, dim in dims.items()}
        by_identity = {id(param): named[name] for name, param in meta.named_parameters(remove_duplicate=False)}
        kept = {id(module) for module in meta.modules()}
        replaced = split_slot(base, mesh, 0)
        return [by_identity.get(id(param), replaced if id(owner) in kept else ShardSlot())
                for param, owner in zip(registered, owners)], named

    def tensor_parallel_plan(self, model: nn.Module, given: Mapping[str, str] | None) -> TensorParallelPlan | None:
        """How `model` is split where the session splits models: `given` (module name patterns ->
        styles), else a transformers model's own plan; checked against the model and the degree
        (a one-line UsageError). None where the session does not split."""
        degree = self.ctx.tp_size
        if degree == 1:
            return None
        if given is not None:
            plan = TensorParallelPlan(dict(given), source="the tensor_parallel_plan")
        else:
            own = model_tensor_parallel_plan(model, self.names["tensor_parallel"])
            if own is None:
                raise UsageError(self.names["tensor_parallel"], degree, f"a plan to split {type(model).__name__} by",
                                 "pass setup(..., tensor_parallel_plan={'blocks.*.fc1': 'colwise', ...}), or set "
                                 "Task.tensor_parallel_plan; transformers models bring their own")
            plan = TensorParallelPlan(own.styles, own.divisible, own.source)
        check_plan(model, plan, degree, self.names["tensor_parallel"])
        return plan

    def plan(self, *, compile_model: bool, grad_comm_dtype: str, cast_outputs_to_fp32: bool, units: Units,
             ddp_options: dict[str, Any], tensor_parallel: TensorParallelPlan | None = None) -> ParallelPlan:
        """The one plan for a model of this session (refused here, before the model is touched)."""
        named = {name: ddp_options[name] for name in _PLAN_DDP_FIELDS if name in ddp_options}
        rest = {name: value for name, value in ddp_options.items() if name not in _PLAN_DDP_FIELDS}
        shard = self.shard
        return ParallelPlan(shard=shard is not None, units=units,
                            reshard_after_forward=shard.reshard_after_forward if shard else True,
                            activation_checkpointing=shard.activation_checkpointing if shard else False,
                            replicate=shard.replicate if shard else 1,
                            param_dtype=shard.param_dtype if shard else "fp32",
                            cpu_offload=shard.cpu_offload if shard else False,
                            grad_comm_dtype=grad_comm_dtype, compile=compile_model,
                            cast_outputs_to_fp32=cast_outputs_to_fp32, ddp_options=rest,
                            tensor_parallel=tensor_parallel, **named)

    def describe(self, model: nn.Module) -> str:
        """What setup applied to `model` (see `Session.describe`)."""
        described = self._described.get(model)
        if described is None:
            raise UsageError("model", type(model).__name__, "a model returned by Session.setup",
                             "pass what session.setup(model) returned")
        return described

    def local_module(self, model: nn.Module) -> AutocastModule:
        """The AutocastModule of a set-up model (see `Session.local_module`)."""
        inner = model.module if isinstance(model, DDP) else model
        if not isinstance(inner, AutocastModule):
            raise UsageError("model", type(model).__name__, "a model returned by Session.setup",
                             "pass what session.setup(model) returned")
        return inner

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """No gradient reduction for the micro-batches in the block (see `Session.no_sync`)."""
        if isinstance(model, DDP):
            return model.no_sync()
        if is_sharded(unwrap_model(model)):
            return _sharded_no_sync(unwrap_model(model))
        return nullcontext()

    def synced_ddp(self) -> list[DDP]:
        """The DDP wrappers alive whose next backward reduces gradients."""
        models = (ref() for ref in self._ddp)
        return [m for m in models if m is not None and m.require_backward_grad_sync]

    def release(self) -> None:
        """Cut the DDP wrappers still alive from the group, before it is destroyed."""
        refs, self._ddp = self._ddp, []
        for ref in refs:
            model = ref()
            if model is not None:
                release_ddp(model)


@contextmanager
def _sharded_no_sync(root: nn.Module) -> Iterator[None]:
    # FSDP2 keeps the unsharded gradients of the block's backwards and reduce-scatters them
    # in the first backward outside it: the same sum as DDP's no_sync.
    root.set_requires_gradient_sync(False)  # type: ignore[operator]  # FSDPModule's, not nn.Module's
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)  # type: ignore[operator]  # FSDPModule's, not nn.Module's
