"""How a model is parallelized: `ParallelPlan`, everything `parallelize` applies, checked once.

A plan is built once per model (by `Session.setup`, from its arguments and the session's
`ShardOptions`) and refuses a combination that cannot run when it is made, in one line
naming the value and the fix, before anything has touched the model or the ranks.
`replicate` > 1 shards within each of that many replicas (HSDP, on the session's
replicate x shard mesh); `tensor_parallel`, a plan of the model's modules, splits its
matmuls over the mesh's `tp` dimension, inside the data-parallel ones (tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ddp_amp.errors import UsageError
from ddp_amp.option_values import TextKind
from ddp_amp.parallel.fsdp import Units
from ddp_amp.parallel.tensor_parallel import TensorParallelPlan
from ddp_amp.torch_api import SELECTIVE_RECOMPUTE, SHARDING

# --grad-comm-dtype: the dtype gradients cross the wire in (None: fp32, DDP's own all-reduce).
COMM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# --shard-param-dtype: the dtype a sharded unit's parameters are all-gathered in (None: as
# stored, fp32, so autocast alone decides the numerics).
PARAM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
# --activation-checkpointing: what each unit recomputes in backward. It was a switch: true and
# false (a config file's, an older run's config.json) are full and none.
CHECKPOINTING_CHOICES = ("none", "full", "selective")


def checkpointing_mode(value: str | bool, where: str = "--activation-checkpointing") -> str:
    """`value` as one of CHECKPOINTING_CHOICES (a bool as the switch meant it), or a one-line UsageError."""
    if isinstance(value, bool):
        return "full" if value else "none"
    mode = {"true": "full", "false": "none"}.get(value, value)
    if mode not in CHECKPOINTING_CHOICES:
        raise UsageError(where, value, "one of " + ", ".join(CHECKPOINTING_CHOICES),
                         "selective keeps the matmul outputs and recomputes the rest; full recomputes everything")
    return mode


CHECKPOINTING = TextKind(checkpointing_mode, lambda mode: checkpointing_mode(mode))


def require_sharding(names: tuple[str, str], checkpointing: bool | str) -> None:
    """Refuse sharding, and selective recompute where `checkpointing` asks for it, in one line
    naming the torch each needs, where this torch is older. `names`: how the caller spells
    the two options (`--shard`, `--activation-checkpointing` or a class's keywords)."""
    SHARDING.require(names[0], True)
    if checkpointing == "selective":
        SELECTIVE_RECOMPUTE.require(names[1], checkpointing)


@dataclass(frozen=True)
class ShardOptions:
    """How a session shards its models (`--shard` and the options that go with it)."""

    # Free each unit's gathered weights after its forward and gather them again for its
    # backward (the memory FSDP saves); False keeps them from forward to backward.
    reshard_after_forward: bool = True
    # Recompute each unit's activations in backward instead of keeping them: "full", or
    # "selective" (keep the matmul outputs); True is full, False and "none" keep them all.
    activation_checkpointing: bool | str = False
    # Replicas of the sharded model (HSDP): each shards it over world size / replicate
    # ranks, and gradients are averaged across replicas. The session lays its mesh out by it.
    # 0: every data-parallel rank holds a replica, nothing sharded (a split model, tensor
    # parallel, spread without sharding: FSDP2 all-reduces its gradients as DDP would).
    replicate: int = 1
    # The dtype parameters are all-gathered in: fp32 (DDP's numerics) or bf16 (half the bytes).
    param_dtype: str = "fp32"
    # Keep parameters, gradients and optimizer state on the host (CUDA runs only).
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing",
                           checkpointing_mode(self.activation_checkpointing, "ShardOptions.activation_checkpointing"))
        require_sharding(("ShardOptions", "ShardOptions.activation_checkpointing"), self.activation_checkpointing)
        if self.replicate < 0:
            raise UsageError("ShardOptions.replicate", self.replicate, "an integer >= 0",
                             "1 shards over every rank; R > 1 makes R replicas, each sharded; 0 replicates")


@dataclass(frozen=True)
class ParallelPlan:
    """What `parallelize` does to one model, in the order it does it."""

    shard: bool = False
    """Shard the model over the data-parallel ranks (FSDP2: per unit, then the root); False
    replicates it (DDP, or nothing but the autocast wrapper for a world of one)."""
    units: Units = None
    """Sharded: the blocks sharded one by one (module classes, or a function of the model);
    None takes the children of the model's largest ModuleList, else its children with
    parameters."""
    reshard_after_forward: bool = True
    """Sharded: free a unit's gathered weights after its forward; False keeps them to backward."""
    activation_checkpointing: bool | str = False
    """Sharded: recompute each unit's activations in backward: "full", "selective" (keep the
    outputs of matmuls and attention, recompute the rest), or "none" (False) to keep them."""
    param_dtype: str = "fp32"
    """Sharded: the dtype parameters are all-gathered in, fp32 or bf16 (then gradients are
    still reduced in fp32 unless grad_comm_dtype says otherwise)."""
    cpu_offload: bool = False
    """Sharded, CUDA only: parameters, gradients and optimizer state live on the host."""
    grad_comm_dtype: str = "fp32"
    """The dtype gradients are reduced in: fp32, bf16 or fp16 (DDP's comm hook, FSDP's
    reduce dtype)."""
    compile: bool = False
    """Compile: replicated, the user's module (inside the autocast wrapper and DDP); sharded,
    each unit's forward (what no unit holds stays eager)."""
    cast_outputs_to_fp32: bool = False
    """The autocast wrapper casts the model's floating outputs to fp32."""
    find_unused_parameters: bool = False
    """DDP: parameters may get no gradient in a step (costs a graph walk per step)."""
    static_graph: bool = False
    """DDP: the set of used parameters and the graph are the same every step."""
    gradient_as_bucket_view: bool = True
    """DDP: gradients are views into its buckets (one copy and one gradient set saved)."""
    ddp_options: Mapping[str, Any] = field(default_factory=dict)
    """DDP: any other keyword of DistributedDataParallel (bucket_cap_mb, ...)."""
    replicate: int = 1
    """Sharded: replicas of the sharded model (HSDP, over the session's replicate x shard
    mesh); 1 shards over every rank."""
    tensor_parallel: TensorParallelPlan | None = None
    """Sharded: split the model's matmuls over the mesh's `tp` dimension as this plan says,
    before FSDP2 spreads it over the data-parallel ones; None: no tensor parallelism."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing",
                           checkpointing_mode(self.activation_checkpointing, "ParallelPlan.activation_checkpointing"))
        if self.replicate != 1 and not self.shard:
            raise UsageError("ParallelPlan.replicate", self.replicate, "1 for a replicated model",
                             "replicas of a sharded model need shard=True (--shard); DDP replicates on every rank")
        if self.tensor_parallel is not None and not self.shard:
            raise UsageError("ParallelPlan.tensor_parallel", self.tensor_parallel.source, "shard=True with it (FSDP2 "
                             "spreads a split model over the data-parallel ranks)",
                             "start the session with tensor_parallel=N: it sets that up")
        if self.grad_comm_dtype not in COMM_DTYPES:
            raise UsageError("--grad-comm-dtype", self.grad_comm_dtype, "one of " + ", ".join(COMM_DTYPES), "")
        if self.param_dtype not in PARAM_DTYPES:
            raise UsageError("--shard-param-dtype", self.param_dtype, "one of " + ", ".join(PARAM_DTYPES), "")
        if self.shard:
            require_sharding(("ParallelPlan.shard", "ParallelPlan.activation_checkpointing"),
                             self.activation_checkpointing)
            # What only DDP does, or sharding does not support yet, in the order setup takes it.
            refused = [name for name, value in self.ddp_keywords().items()
                       if value and name != "gradient_as_bucket_view"]
            if refused:
                raise UsageError("setup option", refused[0], "an option of a sharded model",
                                 f"{refused[0]} is DDP's (or not supported with sharding yet); drop it, or drop "
                                 "sharding")
        elif self.activation_checkpointing != "none" or not self.reshard_after_forward or self.param_dtype != "fp32" \
                or self.cpu_offload:
            option = next(name for name, on in (("activation_checkpointing", self.activation_checkpointing != "none"),
                                                ("reshard_after_forward", not self.reshard_after_forward),
                                                ("param_dtype", self.param_dtype != "fp32"),
                                                ("cpu_offload", self.cpu_offload)) if on)
            raise UsageError(f"ParallelPlan.{option}", getattr(self, option), "its default for a replicated model",
                             "these act per shard unit: set shard=True (--shard), or drop the option")

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype of `grad_comm_dtype`; None for fp32 (no compression)."""
        return COMM_DTYPES[self.grad_comm_dtype]

    @property
    def gather_dtype(self) -> torch.dtype | None:
        """The dtype of `param_dtype`; None for fp32 (gathered as stored)."""
        return PARAM_DTYPES[self.param_dtype]

    def ddp_keywords(self) -> dict[str, Any]:
        """The keywords DDP is made with, beyond the module and its device."""
        return {"find_unused_parameters": self.find_unused_parameters, "static_graph": self.static_graph,
                "gradient_as_bucket_view": self.gradient_as_bucket_view, **self.ddp_options}
