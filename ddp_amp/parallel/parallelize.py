"""`parallelize`: the one place a user's model is made ready to train, every wrapper in order.

    replicated:  DDP(AutocastModule(torch.compile(float8(model))))   (no DDP for a world of one)
    sharded:     AutocastModule(fully_shard(units of float8(model), each checkpointed, then compiled))
    tensor parallel: AutocastModule(fully_shard(units of split(model), each checkpointed, then compiled))

The order, and why:
1. to the device first, so every later step (and DDP's weight broadcast) sees the final
   parameters (a model built sharded, `meta_init`, moves its buffers only: its parameters
   get storage, this rank's shards, once sharded in step 6);
2. float8 conversion before anything records the module structure or compiles it: the
   compiled code then includes the float8 casts, and the units found next are the
   converted modules;
3. the units are found once, on the converted model, and both sharding and the
   description use that one list (described before sharding renames their classes);
   then tensor parallelism splits the units' matmuls over the mesh's `tp` dimension
   (torchtitan's order: the split model is what is checkpointed, compiled and then
   sharded over the data-parallel dimensions, each parameter a 2-d DTensor);
4. activation checkpointing per unit (full or selective, `recompute`) before sharding
   (torchtitan's order too): the composable form keeps parameter names, so the sharded
   state's names stay the model's;
5. compile. Replicated: the user's module whole, so autocast and DDP's hooks stay outside
   the compiled graph, which sees plain tensors. Sharded: each unit's forward, in place and
   before sharding (torchtitan compiles per block too): the units' hooks, FSDP's gathers
   and the checkpointing of step 4, run eagerly around the compiled forward; blocks of one
   class share its compiled code; the parameter names do not change; and what no unit
   holds (embeddings, a head) stays eager;
6. FSDP2 per unit and then the root, on the mesh's data-parallel dimension (its replicate
   x shard dimensions for HSDP), or DDP;
7. the autocast wrapper: inside DDP, so DDP's forward runs the user's forward under autocast
   in whatever thread calls it; outside a sharded root, so autocast is entered before the
   root gathers its weights and the sharded state's names are the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from ddp_amp.amp.autocast import AutocastModule
from ddp_amp.amp.float8 import convert_linears
from ddp_amp.amp.precision import Precision
from ddp_amp.distributed import DistContext
from ddp_amp.errors import UsageError
from ddp_amp.parallel.ddp import comm_hook, wrap_ddp
from ddp_amp.parallel.fsdp import describe_units, shard_model, shard_units
from ddp_amp.parallel.meta_init import is_built_sharded, materialize
from ddp_amp.parallel.plan import ParallelPlan
from ddp_amp.parallel.recompute import checkpoint_units
from ddp_amp.parallel.tensor_parallel import apply_tensor_parallel


@dataclass(frozen=True)
class Parallelized:
    """What `parallelize` made: the model to train and what was applied to it."""

    model: nn.Module
    """The wrapped model: `DDP(AutocastModule(...))`, `AutocastModule(...)` alone, or around
    the sharded root; `unwrap_model` reaches the user's module."""
    description: str
    """One line for a run's start line: 'replicated', or the units, root and options of a
    sharded model."""
    units: tuple[nn.Module, ...] = ()
    """The modules sharded one by one (none when replicated)."""


def parallelize(model: nn.Module, plan: ParallelPlan, precision: Precision, ctx: DistContext) -> Parallelized:
    """Apply `plan` to `model` on this rank (collective where there is a group: DDP's
    weight broadcast, or the ranks agreeing on the sharded layout)."""
    if plan.shard:
        _check_mesh(plan, ctx)
    if plan.cpu_offload and ctx.device.type != "cuda":
        # Offloading moves shards from a GPU to the host: on a CPU run there is nothing to free.
        raise UsageError("--cpu-offload", True, "a CUDA device (it keeps a GPU run's shards on the host)",
                         "drop --cpu-offload on a CPU run, or run with --device cuda")
    built_sharded = is_built_sharded(model)
    if built_sharded and not plan.shard:
        raise UsageError("model", type(model).__name__, "a model built for sharding to be sharded",
                         "it was built with its parameters sliced for --shard; set up the session with shard=")
    # A model built sharded has meta parameters until it is sharded: only its buffers move now.
    inner = _buffers_to(model, ctx.device) if built_sharded else model.to(ctx.device)
    if precision.float8_linears:
        inner = convert_linears(inner, emulate=precision.emulate_fp8)
    units = shard_units(inner, plan.units) if plan.shard else []
    # Described now: sharding changes each unit's class (FSDPLinear for a Linear).
    description = _sharded_description(plan, units, ctx) if plan.shard else "replicated"
    if plan.tensor_parallel is not None:
        inner = apply_tensor_parallel(inner, plan.tensor_parallel, ctx.mesh["tp"], units)  # type: ignore[index]  # checked: a tp mesh
    checkpoint_units(units, str(plan.activation_checkpointing))
    if plan.compile and plan.shard:
        _compile_each(units)
    elif plan.compile:
        inner = torch.compile(inner)  # type: ignore[assignment]  # of a module: an OptimizedModule
    if plan.shard:
        inner = shard_model(inner, units, mesh=ctx.spread_mesh, reshard_after_forward=plan.reshard_after_forward,
                            reduce_dtype=plan.reduce_dtype, param_dtype=plan.gather_dtype,
                            cpu_offload=plan.cpu_offload)
        if built_sharded:
            # Offloaded shards live on the host (FSDP2 moves each to the GPU for its unit's gather).
            materialize(inner, torch.device("cpu") if plan.cpu_offload else ctx.device, built=model)
        wrapped: nn.Module = AutocastModule(inner, precision, cast_outputs_to_fp32=plan.cast_outputs_to_fp32)
        return Parallelized(wrapped, description, tuple(units))
    wrapped = AutocastModule(inner, precision, cast_outputs_to_fp32=plan.cast_outputs_to_fp32)
    if ctx.has_group:
        # A Python comm hook only where compression needs one; else DDP's C++ all-reduce.
        hook = comm_hook(plan.grad_comm_dtype, ctx.backend or "gloo")
        wrapped = wrap_ddp(wrapped, ctx.device, comm_hook=hook, **plan.ddp_keywords())
    return Parallelized(wrapped, description)


def _buffers_to(model: nn.Module, device: torch.device) -> nn.Module:
    for module in model.modules():
        module._buffers.update({name: buffer.to(device) for name, buffer in module._buffers.items()
                                if buffer is not None})
    return model


def _compile_each(units: list[nn.Module]) -> None:
    """Compile each unit's forward, in place. Not `unit.compile()`: that compiles the module's
    `_call_impl`, a frame dynamo skips (torch 2.13) to pick up the forward's frame instead,
    and for torch.nn's own classes (nn.TransformerEncoderLayer, nn.Linear) it skips that one
    too, so nothing would be compiled (docs/sharding.md). Either way only the forward is
    compiled; the hooks around it run eagerly. Static shapes: a new shape (an eval's last,
    shorter batch) compiles once more instead of going symbolic, where float8 units failed
    in inductor (torch 2.13, emulated fp8 on a CPU, a sharded run's final eval)."""
    for unit in units:
        # an attribute of this unit only: `del unit.forward` undoes it
        unit.forward = torch.compile(unit.forward, dynamic=False)


def _sharded_description(plan: ParallelPlan, units: list[nn.Module], ctx: DistContext) -> str:
    recompute = {"full": "activation checkpointing per unit", "none": "",
                 "selective": "selective activation checkpointing per unit"}[str(plan.activation_checkpointing)]
    extras = [text for on, text in ((bool(recompute), recompute),
                                    (plan.compile, "each unit compiled"),
                                    (not plan.reshard_after_forward, "kept gathered from forward to backward"),
                                    (plan.param_dtype != "fp32", f"parameters gathered in {plan.param_dtype}"),
                                    (plan.cpu_offload, "offloaded to the host"))
              if on]
    split = ", ".join(part for part in (_split(plan, ctx), _sequences(ctx)) if part)
    if split and _shard_degree(plan, ctx) == 1:
        spread = f"{split}, replicated over {ctx.dp_size} rank{'s' if ctx.dp_size != 1 else ''}"
    else:
        spread = f"{split + ', ' if split else ''}sharded{_replicas(plan, ctx)}"
    return (f"{spread}: {describe_units(units)} and the model as the root"
            + (f" ({', '.join(extras)})" if extras else ""))


def _split(plan: ParallelPlan, ctx: DistContext) -> str:
    """'tensor parallel over 2 ranks (sequence parallel, loss parallel)', or nothing."""
    tensor = plan.tensor_parallel
    if tensor is None:
        return ""
    kinds = [text for on, text in ((tensor.sequence_parallel, "sequence parallel"),
                                   ("head" in tensor.styles.values(), "loss parallel")) if on]
    return f"tensor parallel over {ctx.tp_size} ranks" + (f" ({', '.join(kinds)})" if kinds else "")


def _sequences(ctx: DistContext) -> str:
    """'context parallel over 2 ranks (all-gather attention)', or nothing."""
    return f"context parallel over {ctx.cp_size} ranks (all-gather attention)" if ctx.cp_size > 1 else ""


def _shard_degree(plan: ParallelPlan, ctx: DistContext) -> int:
    """Over how many ranks each replica of the model is sharded (a cp group's ranks shard it too)."""
    return ctx.dp_size * ctx.cp_size // plan.replicate


def _replicas(plan: ParallelPlan, ctx: DistContext) -> str:
    """' over 2 ranks, replicated 2 times' under HSDP; nothing where every rank holds one shard."""
    if plan.replicate == 1:
        return ""
    ranks = _shard_degree(plan, ctx)
    return f" over {ranks} rank{'s' if ranks != 1 else ''}, replicated {plan.replicate} times"


def _check_mesh(plan: ParallelPlan, ctx: DistContext) -> None:
    """A sharded plan needs a mesh, whose rows are the plan's replicas, and a `tp` dimension
    exactly where the plan splits the model: the session laid it out before any model existed."""
    mesh = ctx.mesh
    if mesh is None:
        raise UsageError("ParallelPlan.shard", True, "a process group with a device mesh",
                         "start the session with shard=ShardOptions(): it forms a group even for one rank")
    names = mesh.mesh_dim_names or ()
    rows = mesh.size(names.index("dp_replicate")) if "dp_replicate" in names else 1
    if rows != plan.replicate:
        raise UsageError("ParallelPlan.replicate", plan.replicate, f"the replicas of the session's mesh ({rows})",
                         "set ShardOptions(replicate=...) on the Session: it lays the ranks out before any model")
    if (plan.tensor_parallel is not None) != (ctx.tp_size > 1):
        raise UsageError("ParallelPlan.tensor_parallel", plan.tensor_parallel is not None,
                         f"a plan exactly where the session's mesh has a tp dimension (its size: {ctx.tp_size})",
                         "start the session with tensor_parallel=N, and set the model up with its plan")
