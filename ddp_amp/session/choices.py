"""What a session is asked to run on and in, resolved before it joins a process group.

A script spells them as torch does (`device="cuda:1"`, `precision="float16"` or
`torch.float16`) or as the command line does (`cuda`, `fp16`); a refusal is one line that
names the option as its caller spelled it: `Session`'s keyword (`precision=`), or, for the
command line's session, the flag (`--precision`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ddp_amp.amp import Precision, resolve_precision
from ddp_amp.distributed import (DeviceChoice, check_context_parallel, check_tensor_parallel, resolve_backend,
                                 resolve_device)
from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError
from ddp_amp.parallel import ShardOptions, check_gather_dtype
from ddp_amp.torch_api import HSDP_OVER_GLOO, TENSOR_PARALLEL

# The names a refusal gives the options: `Session`'s keywords, or the command line's flags.
KEYWORDS: Mapping[str, str] = {"precision": "precision", "device": "device",
                               "param_dtype": "ShardOptions.param_dtype", "replicate": "ShardOptions.replicate",
                               "tensor_parallel": "tensor_parallel", "cpu_offload": "ShardOptions.cpu_offload",
                               "context_parallel": "context_parallel"}
FLAGS: Mapping[str, str] = {"precision": "--precision", "device": "--device", "param_dtype": "--shard-param-dtype",
                            "replicate": "--replicate", "tensor_parallel": "--tensor-parallel",
                            "cpu_offload": "--cpu-offload", "context_parallel": "--context-parallel"}


def resolve_choices(precision: str | torch.dtype, device: DeviceChoice, backend: str, env: DistEnv,
                    fp8_emulate: bool, shard: ShardOptions | None,
                    names: Mapping[str, str], tensor_parallel: int = 1) -> tuple[torch.device, Precision]:
    """This rank's device and precision, or a one-line UsageError naming the option by `names`
    (no collective: every rank of a node decides alike)."""
    chosen = resolve_device(device, env, backend, names["device"])
    resolved = resolve_precision(precision, chosen, fp8_emulate, names["precision"])
    if tensor_parallel > 1 and resolved.float8_linears:
        # torch's parallel styles split nn.Linear; float8's linears need styles of their own (torchao's)
        raise UsageError(names["precision"], "fp8", f"bf16 or fp32 with {names['tensor_parallel']}",
                         "float8 linear layers are not split by tensor parallelism here; drop one of them")
    if shard is not None:
        check_gather_dtype(shard.param_dtype, resolved.name, (names["param_dtype"], names["precision"]))
        if shard.replicate > 1 and resolve_backend(backend, chosen) == "gloo":  # type: ignore[arg-type]
            HSDP_OVER_GLOO.require(names["replicate"], shard.replicate)
    return chosen, resolved


def layout_shard(shard: ShardOptions | None, tensor_parallel: int, env: DistEnv,
                 names: Mapping[str, str], context_parallel: int = 1) -> ShardOptions | None:
    """FSDP2's settings for the session: its own `shard`, or, where a split model has none,
    every data-parallel rank a replica (FSDP2 sharding over one rank each, or over the ranks
    of a cp group, which hold one model: gradients all-reduced, as DDP does, over a model DDP
    cannot wrap). A one-line UsageError naming the option by `names` for a degree the ranks
    cannot be laid out in."""
    if tensor_parallel > 1:
        TENSOR_PARALLEL.require(names["tensor_parallel"], tensor_parallel)
        check_tensor_parallel(tensor_parallel, env, names["tensor_parallel"])
    if context_parallel > 1:
        check_context_parallel(context_parallel, tensor_parallel, env, names["context_parallel"])
    replicas = env.world_size // max(tensor_parallel * context_parallel, 1)  # every data-parallel rank one
    if shard is not None and shard.replicate == 0:
        shard = replace(shard, replicate=replicas)
    if tensor_parallel == 1 and context_parallel == 1:
        return shard
    if shard is None:
        return ShardOptions(replicate=replicas)
    if shard.cpu_offload:
        flag = names["tensor_parallel" if tensor_parallel > 1 else "context_parallel"]
        raise UsageError(names["cpu_offload"], True, f"no offload with {flag}",
                         "a split model's shards stay on the GPU; drop one of them")
    return shard
