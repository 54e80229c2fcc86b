"""The parallelism options of a run: DDP or FSDP2 (`--shard`) and what goes with each."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.errors import UsageError, spelled
from ddp_amp.option_values import INT_LIMIT, ComponentOptions, check_fields, flag_of, option
from ddp_amp.parallel.plan import CHECKPOINTING, CHECKPOINTING_CHOICES, require_sharding


@dataclass(frozen=True)
class ParallelOptions(ComponentOptions):
    """How the model is replicated or sharded over the ranks, compiled and its gradients reduced."""

    # --- sharding: models larger than one GPU ---
    shard: bool = option(False, "shard the model, its gradients and the optimizer state over the ranks (FSDP2) "
                         "instead of replicating them (DDP): each rank holds 1/N; the task's blocks "
                         "(Task.shard_units) are the units; checkpoints are written sharded (each rank its part)")
    reshard_after_forward: bool = option(True, "with --shard: free each unit's gathered weights after its forward "
                                         "and gather them again for backward (--no-reshard-after-forward keeps "
                                         "them, more memory, less communication)")
    activation_checkpointing: str = option("none", "with --shard: recompute each unit's activations in backward "
                                           "instead of keeping them: full (all of them: least memory, one more "
                                           "forward per unit) or selective (keep the matmul and attention outputs, "
                                           "recompute the cheap ops between them: most of the memory saved for a "
                                           "fraction of the time)", CHECKPOINTING_CHOICES, kind=CHECKPOINTING,
                                           bare="full")
    replicate: int = option(1, "with --shard: R replicas of the sharded model (HSDP), each sharded over world "
                            "size / R ranks; gradients are reduce-scattered within a replica and all-reduced "
                            "across replicas (R must divide the world size; 1 shards over every rank)",
                            limits=(1, INT_LIMIT))
    shard_param_dtype: str = option("fp32", "with --shard: dtype each unit's parameters are all-gathered in: "
                                    "fp32 (DDP's numerics exactly) or bf16 (half the gather traffic, bf16 "
                                    "weights in every op; gradients still reduced in fp32 unless "
                                    "--grad-comm-dtype says otherwise)", ("fp32", "bf16"))
    cpu_offload: bool = option(False, "with --shard, CUDA only: keep parameters, gradients and optimizer "
                               "state on the host (FSDP2's CPUOffloadPolicy); the optimizer steps on the "
                               "CPU, so much slower, for models whose shards do not fit the GPU")
    # --- tensor parallelism: splitting each block's matmuls inside a node ---
    tensor_parallel: int = option(1, "split each block's matmuls over N ranks of a node (tensor parallel, with "
                                  "sequence and loss parallel), the innermost dimension of the mesh: replicate x "
                                  "shard x tensor parallel; the data-parallel ranks are world size / N. N must "
                                  "divide the ranks per node; the plan is the model's own (transformers) or "
                                  "Task.tensor_parallel_plan", limits=(1, INT_LIMIT))
    # --- context parallelism: splitting each sequence ---
    context_parallel: int = option(1, "split every sequence over N ranks (context parallel, for windows too long "
                                   "for one GPU's activations): each keeps 2 of 2N chunks, attention all-gathers "
                                   "the keys and values, exact under causal and document masks; the mesh is "
                                   "replicate x shard x context parallel x tensor parallel and the data-parallel "
                                   "ranks are world size / (N x --tensor-parallel). A transformers model's "
                                   "attention only (--task causal_lm)", limits=(1, INT_LIMIT))
    # --- performance fast paths (measured by python -m ddp_amp.bench) ---
    compile: bool = option(False, "torch.compile the model (inside the autocast wrapper, under DDP; with "
                           "--shard each unit's forward, the root's own layers stay eager) and the loss; "
                           "the first steps pay the compile time. Pays on transformers, not on steps too "
                           "short to be GPU-bound (docs/benchmarks.md has the figures)")
    grad_comm_dtype: str = option("fp32", "dtype gradients are reduced in (DDP's all-reduce, --shard's "
                                  "reduce-scatter): fp32, or bf16/fp16 (half the traffic, less precise sums)",
                                  ("fp32", "bf16", "fp16"))
    static_graph: bool = option(False, "tell DDP the graph is the same every step (same parameters "
                                "used, no data-dependent control flow); lets it skip per-step work")

    def check(self) -> None:
        """Choices, and the options that belong to one of DDP and FSDP2 only."""
        check_fields(self, ParallelOptions)
        split_flag = "tensor_parallel" if self.tensor_parallel > 1 else "context_parallel"
        if self.spread_by_fsdp and self.static_graph:
            raise UsageError(flag_of("static_graph"), True, f"an option that works with {flag_of(split_flag)}",
                             f"{flag_of('static_graph')} is DDP's; a split model is spread by FSDP2: drop it")
        if self.context_parallel > 1 and self.compile:
            raise UsageError(flag_of("compile"), True, f"no {flag_of('compile')} with {flag_of('context_parallel')}",
                             "the split attention's gathers are not compiled yet: drop one of them")
        if self.shard:
            if self.static_graph:
                raise UsageError(flag_of("static_graph"), True, "an option that works with --shard",
                                 f"{flag_of('static_graph')} is not supported with --shard yet; drop one of them")
            require_sharding((flag_of("shard"), flag_of("activation_checkpointing")), self.activation_checkpointing)
        else:
            # A split model is spread by FSDP2 even without --shard (its data-parallel ranks
            # replicate it): the options of FSDP2's units apply to it; replicas are its own layout.
            split = self.spread_by_fsdp
            on = [name for name, asked in (("activation_checkpointing", self.activation_checkpointing != "none"),
                                           ("reshard_after_forward", not self.reshard_after_forward),
                                           ("replicate", self.replicate != 1),
                                           ("shard_param_dtype", self.shard_param_dtype != "fp32"),
                                           ("cpu_offload", self.cpu_offload))
                  if asked and not (split and name != "replicate")]
            if on:
                raise UsageError(flag_of(on[0]), getattr(self, on[0]), "--shard with it (it is a sharding option)",
                                 "add --shard, or drop it")


    @property
    def spread_by_fsdp(self) -> bool:
        """Whether FSDP2 spreads the model even without --shard: a model split by tensor or
        context parallelism, which DDP cannot wrap (its data-parallel ranks then replicate it)."""
        return self.tensor_parallel > 1 or self.context_parallel > 1


def check_gather_dtype(param_dtype: str, precision: str, names: tuple[str, str]) -> None:
    """Refuse parameters gathered in bf16 for fp16 compute, in one line naming `names` (the
    gather option's, the precision's). FSDP would hand each unit bf16 weights and cast its
    inputs, the activations between units, to bf16, which autocast then casts to fp16 per
    op: bf16's 8-bit mantissa and fp16's narrow range at once (and torch's CPU layer norm
    refuses the mix outright)."""
    if param_dtype == "bf16" and precision == "fp16":
        gather, compute = names
        raise UsageError(gather, param_dtype, f"fp32 gathers under {spelled(compute, 'fp16')}",
                         f"bf16 gathers go with bf16 compute: use {spelled(compute, 'bf16')}, or "
                         f"{spelled(gather, 'fp32')} with fp16")
