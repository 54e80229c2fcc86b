"""Sharding a model over the ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`), in place of DDP.

Each rank keeps 1/N of every parameter, of its gradient and of the optimizer state built on
it (per-parameter DTensors, `Shard(0)`); a unit's full weights are all-gathered just before
its forward and backward and freed after, and gradients are reduce-scattered. Units are the
blocks of the model (`units`: what the task names, else `default_units`); the model itself
is sharded last, as the root, holding what no unit holds (embeddings, a final norm, a head).

Precision is not FSDP's job by default: parameters are gathered fp32 (`MixedPrecisionPolicy`
with no `param_dtype`) and the autocast wrapper around the root casts per op, exactly as it
does around DDP, so `--precision` means the same numerics sharded or not (docs/sharding.md).
`param_dtype` bf16 (`--shard-param-dtype`) gathers them in bf16 instead, half the bytes, at
the price of bf16 weights in every op. `reduce_dtype` is `--grad-comm-dtype`'s, the dtype
gradients are reduce-scattered in. `cpu_offload` keeps the shards on the host (CUDA only).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ddp_amp.errors import UsageError
from ddp_amp.torch_api import CPUOffloadPolicy, DTensor, MixedPrecisionPolicy, OffloadPolicy, fully_shard

# What a task may name its units by: module classes, or a function of the model.
Units = tuple[type[nn.Module], ...] | Callable[[nn.Module], Iterable[nn.Module]] | None


def default_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of a model that names none: the children of its largest `nn.ModuleList`
    (a transformer's layers), else its direct children that hold parameters."""
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)]
    if lists:
        largest = max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))
        return list(largest)
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard_units(model: nn.Module, units: Units) -> list[nn.Module]:
    """The modules of `model` to shard as units, by what the task named (or the default)."""
    if units is None:
        return default_units(model)
    if callable(units) and not isinstance(units, type) and not isinstance(units, tuple):
        found = list(units(model))
    else:
        classes = units if isinstance(units, tuple) else (units,)
        found = [module for module in model.modules() if isinstance(module, classes) and module is not model]
    if not found or not all(isinstance(module, nn.Module) for module in found):
        raise UsageError("Task.shard_units", _describe(units), "module classes or a function naming modules of "
                         "the model", f"none matched in {type(model).__name__}; name its blocks' class, e.g. "
                         "shard_units=(nn.TransformerEncoderLayer,)")
    return found


def _describe(units: Units) -> str:
    if isinstance(units, tuple):
        return ", ".join(cls.__name__ for cls in units)
    return getattr(units, "__name__", repr(units))


def shard_model(model: nn.Module, units: list[nn.Module], *, mesh: DeviceMesh | None,
                reshard_after_forward: bool = True, reduce_dtype: torch.dtype | None = None,
                param_dtype: torch.dtype | None = None, cpu_offload: bool = False) -> nn.Module:
    """`fully_shard` every unit, then the model as the root, over `mesh` (collective: the
    ranks agree on the layout). The model is the same object afterwards, now an FSDPModule.

    `reshard_after_forward` frees each unit's gathered weights after its forward (False keeps
    them until its backward); `reduce_dtype` None reduces gradients in fp32; `param_dtype`
    None gathers parameters as stored (fp32); `cpu_offload` keeps the shards on the host."""
    unit_policy, root_policy = _precision_policies(param_dtype, reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=unit_policy, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, reshard_after_forward=reshard_after_forward,
                offload_policy=offload)
    # The root's output is often a view (a Linear over a 3-d input): FSDP warns in case it is
    # modified in place, which the loss never does.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def _precision_policies(param_dtype: torch.dtype | None,
                        reduce_dtype: torch.dtype | None) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """The units' policy and the root's. Gathered as stored, both are today's exact policy.
    Gathered in a lower dtype: FSDP would reduce gradients in that dtype too where no reduce
    dtype is named, so fp32 is named (the torchtitan policy); and the root hands its outputs
    back in fp32, so the loss is computed in fp32 as under autocast (units pass theirs on in
    the gather dtype, which the next unit would cast to anyway)."""
    if param_dtype is None:
        exact = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        return exact, exact
    reduce = reduce_dtype or torch.float32
    return (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce),
            MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce, output_dtype=torch.float32))


def describe_units(units: list[nn.Module]) -> str:
    """'2 x TransformerEncoderLayer' or '1 x Linear, 2 x Block': what the start line prints."""
    counts: dict[str, int] = {}
    for unit in units:
        counts[type(unit).__name__] = counts.get(type(unit).__name__, 0) + 1
    return ", ".join(f"{count} x {name}" for name, count in counts.items())


def fused_kernel_takes(kind: type[torch.optim.Optimizer], params: Iterable[torch.Tensor]) -> bool:
    """Whether `kind`'s fused kernel runs over these parameters: SGD's has no form for sharded
    (DTensor) ones in torch 2.13 (its step raises), AdamW's and Adam's have."""
    return not (issubclass(kind, torch.optim.SGD) and any(isinstance(p, DTensor) for p in params))
