"""How a model is spread over the ranks: one `parallelize(model, plan, precision, ctx)`.

- `plan`: `ParallelPlan`, what is applied to a model, checked when it is made; and
  `ShardOptions`, a session's choice to shard;
- `parallelize`: float8, activation checkpointing, compile, FSDP2 or DDP and the autocast
  wrapper, applied in one place in an order its docstring explains;
- `ddp`: the one DDP wrap, its comm hook, and releasing it before teardown;
- `meta_init`: building a model to shard with only this rank's rows of each parameter
  (what a parameter holds meanwhile: `shard_rows`; its random fills: `row_draws`; their
  memory: `host_pages`);
- `fsdp`: sharding a model's units and root with FSDP2 (`--shard`), and what units are;
- `tensor_parallel`: splitting a model's matmuls over the mesh's `tp` dimension by a plan
  (`--tensor-parallel`), with sequence and loss parallel;
- `context_parallel`: splitting every sequence over the mesh's `cp` dimension
  (`--context-parallel`): the batch's cut and the all-gather attention;
- `options`: `ParallelOptions`, the run's choices among them (flags).

Imports `amp`, `distributed`, `hf` and `errors` from ddp_amp; the session builds on it.
"""

from ddp_amp.parallel.context_parallel import SequenceSplit, split_attention
from ddp_amp.parallel.ddp import CommHook, comm_hook, release_ddp, wrap_ddp
from ddp_amp.parallel.fsdp import (Units, default_units, describe_units, fused_kernel_takes, shard_model,
                                   shard_units)
from ddp_amp.parallel.init_skip import meta_model
from ddp_amp.parallel.meta_init import build_sharded, build_whole, is_built_sharded
from ddp_amp.parallel.parallelize import Parallelized, parallelize
from ddp_amp.parallel.options import check_gather_dtype
from ddp_amp.parallel.plan import ParallelPlan, ShardOptions
from ddp_amp.parallel.shard_rows import ShardSlot, shard_slot, split_slot
from ddp_amp.parallel.tensor_parallel import STYLES, TensorParallelPlan, check_plan, split_dims

__all__ = [
    "STYLES", "CommHook", "ParallelPlan", "Parallelized", "SequenceSplit", "ShardOptions", "ShardSlot",
    "TensorParallelPlan", "Units",
    "build_sharded", "build_whole", "check_gather_dtype", "check_plan", "comm_hook", "default_units",
    "describe_units", "fused_kernel_takes", "is_built_sharded", "meta_model", "parallelize", "release_ddp",
    "shard_model", "shard_slot", "shard_units", "split_attention", "split_dims", "split_slot", "wrap_ddp",
]
