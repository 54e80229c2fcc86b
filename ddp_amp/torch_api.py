"""What ddp_amp uses of torch that differs between the torch versions it supports, or that
torch keeps private: decided here, once. Every other module takes such a name from here, so
none fails at import on a supported torch, and a reader finds each version decision and
each private use in one file (tests/test_torch_api.py checks every entry on the running torch).

Supported: torch >= 2.4, < 3 (`SUPPORTED`; pyproject.toml says the same). The core, DDP and
AMP in fp32, bf16 and fp16 with its agreed loss scaler, checkpoints and resume, runs on all
of it. What needs a newer torch is a `Feature`: it names the oldest torch that has the
public API it uses and was found to run it, and `Feature.require` refuses it on an older
one in one line that names that version (a UsageError, so exit 2, raised while options are checked, before anything is
written). On such a torch the names below stand in for what is missing: a class that no
object is an instance of (so `isinstance(p, DTensor)` is False) and that refuses, naming
the version, if it is called.

Private torch APIs still used, and why (none has a public form from 2.4 to 2.15):
- `tree_map`, `tree_flatten` (`torch.utils._pytree`): torch's own walk over nested
  arguments, the one that knows torch's containers; torch has no public pytree module.
- `TorchDispatchMode` (`torch.utils._python_dispatch`): the only hook that sees every op
  with its real arguments (the build's random stream replay, the activation-memory bench).
- `make_wrapper_subclass`, `disabled_torch_function_impl` (`torch.Tensor._make_wrapper_subclass`,
  `torch._C._disabled_torch_function_impl`): how a tensor subclass that holds no storage of
  its own is made (the sharded build's placeholders); torch's own subclasses use the same.
- `composable_checkpoint` (`torch.distributed._composable.checkpoint`): activation
  checkpointing that keeps parameter names; the public wrappers insert a module level and
  rename every parameter, which would change a sharded checkpoint's names.
- `compute_local_shape_and_global_offset` (`torch.distributed.tensor._utils`): where a
  DTensor's local shard lies in the whole tensor, to read just those rows from a file.
- `dcp_metadata_path`: where DCP's file reader keeps its map (`_get_metadata_path`, where
  torch has it), for the reader that loads that map with a restricted unpickler.
- `DCP_PICKLED_GLOBALS`: the private globals DCP's metadata pickle names
  (`_StorageInfo`, `torch.serialization._get_layout`, `_MEM_FORMAT_ENCODING`), allow-listed
  by the restricted unpickler that reads a sharded checkpoint's map.
- `record_memory_history`, `dump_memory_snapshot` (`torch.cuda.memory._record_memory_history`,
  `_dump_snapshot`): the CUDA memory snapshot, documented by torch under these names.
- `cpu_has_native_bf16` reads `torch.cpu._is_avx512_bf16_supported` and
  `_is_amx_tile_supported` where torch has them (2.5 on), else the kernel's CPU flags.
- `compiled_graphs` reads dynamo's tally (`torch._dynamo.utils.counters`): the one count of
  the graphs compiled so far, which the log shows under `--compile` (recompiles show as growth).
- `GRAD_SCALER_INTERNALS`: `ddp_amp.amp.scaler.AgreedGradScaler` extends torch's
  GradScaler through its per-optimizer state and helpers (the found-inf flags it agrees on
  across ranks, the fused-optimizer step); GradScaler has no public hook for either.
"""

from __future__ import annotations

import argparse
import codecs
import inspect
import os
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint import state_dict_saver as _dcp_saver
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ddp_amp.errors import UsageError

__all__ = [
    "COMPILER_STANCE", "DCP_PICKLED_GLOBALS", "DOCUMENT_MASKS", "FEATURES", "FUSED_TRANSFORMER_IGNORES_CPU_AUTOCAST",
    "GLOO_CONNECTS_LAZILY", "GLOO_LAZY_INIT", "GRAD_SCALER_INTERNALS", "HSDP_OVER_GLOO", "NEWER_TORCHRUN_OPTIONS",
    "SAC_IGNORED_OPS", "SELECTIVE_RECOMPUTE", "SHARDING", "SUPPORTED", "TENSOR_PARALLEL", "TORCH_RELEASE",
    "AsyncSaveResponse", "CPUOffloadPolicy", "CheckpointPolicy", "ColwiseParallel", "DTensor", "FSDPModule", "Feature",
    "MixedPrecisionPolicy", "OffloadPolicy", "Replicate", "RowwiseParallel", "SequenceParallel", "Shard",
    "TorchDispatchMode", "compiled_eagerly", "compiled_graphs", "composable_checkpoint",
    "compute_local_shape_and_global_offset", "cpu_has_native_bf16", "create_selective_checkpoint_contexts",
    "dcp_metadata_path", "disabled_torch_function_impl", "dump_memory_snapshot", "fully_shard",
    "lazily_connected_gloo", "loss_parallel", "make_wrapper_subclass", "parallelize_module", "profiler_keeps_events",
    "record_memory_history", "release", "safe_globals", "set_transformer_fastpath", "torchrun_knows", "tree_flatten",
    "tree_map",
]

# torch >= 2.4, < 3: the oldest minor release and the first excluded one.
SUPPORTED = ((2, 4), (3, 0))


def release(version: str) -> tuple[int, int]:
    """`version`'s major and minor release: "2.4.1+cu121" -> (2, 4); "2.16.0a0+git..." -> (2, 16)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


TORCH_RELEASE = release(torch.__version__)


def _spelled(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class Feature:
    """Something ddp_amp offers only from torch `needs` on, for the public API it uses."""

    name: str
    """What it is, as the refusal names it ("sharding (FSDP2)")."""
    needs: tuple[int, int]
    """The oldest torch release that has every name in `uses`."""
    uses: tuple[str, ...]
    """The dotted names of torch's it uses (the tests check each resolves where it is available)."""

    def available(self, version: str = torch.__version__) -> bool:
        """Whether torch `version` (by default the running one) has it."""
        return release(version) >= self.needs

    def require(self, what: str, value: object, version: str = torch.__version__, *,
                otherwise: str | None = None) -> None:
        """Refuse `what`=`value` (the option that asks for this feature) in one line naming the
        torch it needs, where torch `version` (by default the running one) is older.
        `otherwise`: what else the user can do (by default, drop `what`)."""
        if not self.available(version):
            needed = _spelled(self.needs)
            instead = otherwise or f"drop {what}: DDP and AMP run on any torch >= {_spelled(SUPPORTED[0])}"
            raise UsageError(what, value, f"torch >= {needed} for {self.name}, this is torch {version}",
                             f"pip install 'torch>={needed}', or {instead}")


SHARDING = Feature("sharding (FSDP2)", (2, 7), (
    "torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.FSDPModule",
    "torch.distributed.fsdp.MixedPrecisionPolicy", "torch.distributed.fsdp.CPUOffloadPolicy",
    "torch.distributed.fsdp.OffloadPolicy", "torch.distributed.tensor.DTensor", "torch.distributed.tensor.Replicate",
    "torch.nn.utils.clip_grads_with_norm_"))
"""`--shard` and everything under it: HSDP (`--replicate`), `--cpu-offload`,
`--shard-param-dtype`, `--compile` per unit, DCP sharded checkpoints, the sharded build.
FSDP2 is public from torch 2.6, but 2.6's fails its first all-gather on a CPU ("'Stream'
object has no attribute 'record_event'"); 2.7 trains, clips, recomputes selectively and
resumes sharded (tried on 2.6.0 and 2.7.1, CPU, gloo)."""

SELECTIVE_RECOMPUTE = Feature("selective activation checkpointing", (2, 5), (
    "torch.utils.checkpoint.create_selective_checkpoint_contexts", "torch.utils.checkpoint.CheckpointPolicy",
    "torch.utils.checkpoint.SAC_IGNORED_OPS"))
"""`--activation-checkpointing selective` (itself an option of `--shard`)."""

HSDP_OVER_GLOO = Feature("HSDP (replicas of a sharded model) over gloo", (2, 13), ())
"""`--replicate` > 1 on a CPU group: torch 2.7's FSDP2 all-reduces across replicas with
ReduceOp.AVG, which gloo refuses ("Cannot use ReduceOp.AVG with Gloo"); 2.13 and 2.15 run
it. The releases between were not tried, so the oldest that runs it is named. Over NCCL
sharding's own bound holds."""

DOCUMENT_MASKS = Feature("attention kept within each document of a packed window", (2, 6), ())
"""`--task causal_lm --task-opt boundaries=true`: the positions restart per document, and
transformers turns restarting positions into a mask that keeps attention within each
document only on torch 2.6 or newer (its masking_utils); on an older torch the documents
would attend across their boundaries without a word (seen on 2.4.1 with transformers 4.56)."""

COMPILER_STANCE = Feature("running compiled code eagerly for a while", (2, 6), ("torch.compiler.set_stance",))
"""What lets the first step's FLOPs be counted under `--compile` (metrics/throughput.py):
compiled code runs eagerly inside `torch.compiler.set_stance("force_eager")` and compiles
on its next call. Without it (2.4, 2.5) a compiled run's FLOPs are not counted."""

TENSOR_PARALLEL = Feature("tensor parallelism", (2, 13), (
    "torch.distributed.tensor.parallel.parallelize_module", "torch.distributed.tensor.parallel.ColwiseParallel",
    "torch.distributed.tensor.parallel.RowwiseParallel", "torch.distributed.tensor.parallel.SequenceParallel",
    "torch.distributed.tensor.parallel.loss_parallel", "torch.distributed.tensor.Shard"))
"""`--tensor-parallel` and `Session(tensor_parallel=)`: the DTensor parallel styles, their
`src_data_rank`, loss parallel, composed with FSDP2 on a 2-d or 3-d mesh (HSDP over gloo
where the data-parallel ranks replicate). Found to run, exact against one rank, on 2.13; the
releases before it were not tried."""

FEATURES = (SHARDING, SELECTIVE_RECOMPUTE, HSDP_OVER_GLOO, DOCUMENT_MASKS, COMPILER_STANCE, TENSOR_PARALLEL)

FUSED_TRANSFORMER_IGNORES_CPU_AUTOCAST = TORCH_RELEASE < (2, 6)
"""Whether torch's fused inference path of `nn.TransformerEncoderLayer` (its "fast path",
taken in eval mode without gradients) fails under CPU autocast: in torch 2.4 and 2.5 the
layer takes it under CPU autocast and the kernel meets low-precision activations against
fp32 weights ("mat1 and mat2 must have the same dtype"); 2.6 runs it (tried on 2.4.1, 2.5.1,
2.6.0 and 2.13.0)."""


class _Missing:
    """Stands in for a class or function of torch's that this torch lacks: no object is an
    instance of it, and calling it refuses in one line naming the torch that has it."""

    feature: Feature
    qualified: str

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        cls.feature.require(cls.qualified, "called")
        raise UsageError(cls.qualified, "called", f"a torch that has {cls.qualified}", "upgrade torch")


def _missing(feature: Feature, qualified: str) -> Any:
    return type(qualified.rsplit(".", 1)[1], (_Missing,), {"feature": feature, "qualified": qualified})


# --- sharding: FSDP2 and DTensor (public from torch 2.6 and 2.5; sharding needs 2.7) ---
if TYPE_CHECKING or SHARDING.available():
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
else:
    CPUOffloadPolicy = _missing(SHARDING, "torch.distributed.fsdp.CPUOffloadPolicy")
    FSDPModule = _missing(SHARDING, "torch.distributed.fsdp.FSDPModule")
    MixedPrecisionPolicy = _missing(SHARDING, "torch.distributed.fsdp.MixedPrecisionPolicy")
    OffloadPolicy = _missing(SHARDING, "torch.distributed.fsdp.OffloadPolicy")
    fully_shard = _missing(SHARDING, "torch.distributed.fsdp.fully_shard")
    DTensor = _missing(SHARDING, "torch.distributed.tensor.DTensor")
    Replicate = _missing(SHARDING, "torch.distributed.tensor.Replicate")
    compute_local_shape_and_global_offset = _missing(SHARDING, "torch.distributed.tensor._utils."
                                                     "compute_local_shape_and_global_offset")

# --- tensor parallelism (public from torch 2.3; found to run on 2.13) ---
if TYPE_CHECKING or TENSOR_PARALLEL.available():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   loss_parallel, parallelize_module)
else:
    Shard = _missing(TENSOR_PARALLEL, "torch.distributed.tensor.Shard")
    ColwiseParallel = _missing(TENSOR_PARALLEL, "torch.distributed.tensor.parallel.ColwiseParallel")
    RowwiseParallel = _missing(TENSOR_PARALLEL, "torch.distributed.tensor.parallel.RowwiseParallel")
    SequenceParallel = _missing(TENSOR_PARALLEL, "torch.distributed.tensor.parallel.SequenceParallel")
    loss_parallel = _missing(TENSOR_PARALLEL, "torch.distributed.tensor.parallel.loss_parallel")
    parallelize_module = _missing(TENSOR_PARALLEL, "torch.distributed.tensor.parallel.parallelize_module")

# --- selective activation checkpointing, public from torch 2.5 ---
if TYPE_CHECKING or SELECTIVE_RECOMPUTE.available():
    from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts
else:
    SAC_IGNORED_OPS: set[Any] = set()
    CheckpointPolicy = _missing(SELECTIVE_RECOMPUTE, "torch.utils.checkpoint.CheckpointPolicy")
    create_selective_checkpoint_contexts = _missing(SELECTIVE_RECOMPUTE, "torch.utils.checkpoint."
                                                    "create_selective_checkpoint_contexts")

# --- DCP's async save returns a response object in newer torch (2.13 has it), the Future in 2.4 ---
if TYPE_CHECKING or hasattr(_dcp_saver, "AsyncSaveResponse"):
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
else:
    class AsyncSaveResponse:
        """Nothing `dcp.async_save` returns on this torch (it returns the Future itself)."""

def dcp_metadata_path(reader: Any, rank: int | None) -> Any:
    """Where DCP's file reader `reader` keeps the map of the shards (`rank`: a per-rank map,
    where torch writes those). Newer torch says so through a private method; torch 2.7 has
    none, and keeps the one map as `.metadata` in the checkpoint's folder."""
    located = getattr(reader, "_get_metadata_path", None)
    if located is not None:
        return located(rank)
    return reader.fs.concat_path(reader.path, ".metadata")


# --- private, in every supported torch (see the module docstring for why each) ---
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
disabled_torch_function_impl = torch._C._disabled_torch_function_impl

# (module, name) -> object: the private globals a DCP metadata pickle names.
DCP_PICKLED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    (_dcp_metadata.__name__, "_MEM_FORMAT_ENCODING"): _dcp_metadata._MEM_FORMAT_ENCODING,
}

# What AgreedGradScaler reads or calls of torch's GradScaler beyond its public API.
GRAD_SCALER_INTERNALS = ("_per_optimizer_states", "_unscale_grads_", "_check_scale_growth_tracker",
                         "_check_inf_per_device", "_scale", "_growth_tracker", "_enabled")


def composable_checkpoint(module: torch.nn.Module, **options: Any) -> None:
    """Activation-checkpoint `module` in place, keeping its parameters' names (`options`:
    `context_fn` for a selective policy)."""
    from torch.distributed._composable import checkpoint  # imported where used: it pulls in torch.distributed

    checkpoint(module, **options)


# Options of torchrun's that ddp_amp's launchers pass and older torchruns lack (2.7's has
# neither; 2.13's has both): the signals its agent forwards to the workers, and how long it
# waits for them after forwarding one.
NEWER_TORCHRUN_OPTIONS = ("--signals-to-handle", "--shutdown-timeout")


def torchrun_knows(option: str) -> bool:
    """Whether this torch's torchrun takes `option` (as `--option=value`)."""
    from torch.distributed.run import get_args_parser  # imported where used: the launcher's parser

    parser = get_args_parser()
    parser.exit_on_error = False  # a known option that refuses the probe's value raises, unprinted
    try:
        _, unknown = parser.parse_known_args([f"{option}=1", "script.py"])
    except argparse.ArgumentError:
        return True
    return not unknown


def profiler_keeps_events() -> dict[str, Any]:
    """What `torch.profiler.profile` is given so that a finished window's events are kept for
    its trace: `acc_events=True` where torch has it (2.5 on); torch 2.4 has no such keyword,
    and keeps one window's events as it is."""
    from torch.profiler import profile

    return {"acc_events": True} if "acc_events" in inspect.signature(profile.__init__).parameters else {}


def record_memory_history(max_entries: int) -> None:
    """Start recording CUDA allocations for a memory snapshot."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the CUDA memory snapshot recorded so far to `path` (a pickle torch's viewer reads)."""
    torch.cuda.memory._dump_snapshot(path)


# What newer torch's weights_only loader accepts by default and 2.4's does not: the
# `_codecs.encode` a pickled numpy scalar names (2.5 allows it).
_LOADER_DEFAULTS_MISSING: list[Any] = [codecs.encode] if TORCH_RELEASE < (2, 5) else []


@contextmanager
def safe_globals(allowed: list[Any]) -> Iterator[None]:
    """`torch.load(weights_only=True)` also accepts `allowed` inside the block. torch 2.5 on
    has this context manager; torch 2.4 has only the process-wide list, which is restored on
    exit here, and lacks a default that numpy scalars need."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:
        with scoped(allowed):
            yield
        return
    before = list(torch.serialization.get_safe_globals())  # a copy: 2.4 hands out its live list
    torch.serialization.add_safe_globals([*allowed, *_LOADER_DEFAULTS_MISSING])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def compiled_eagerly() -> AbstractContextManager[Any]:
    """Inside it, whatever `torch.compile` wrapped runs eagerly and is compiled on its next
    call outside (COMPILER_STANCE; torch 2.6 on)."""
    COMPILER_STANCE.require("compiled_eagerly()", "called")
    return torch.compiler.set_stance("force_eager")


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far (its own tally, which
    torch keeps in `torch._dynamo.utils.counters`; 0 before anything was compiled)."""
    from torch._dynamo.utils import counters  # imported where used: dynamo loads with the optimizer anyway

    return int(counters["stats"]["unique_graphs"])


# Read by ProcessGroupGloo as it is made (torch 2.8 on; found running on 2.13): "1" connects a
# pair of ranks when a collective first joins them, instead of every pair as the group forms.
# An older torch ignores it and connects every pair, as before.
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
GLOO_CONNECTS_LAZILY = TORCH_RELEASE >= (2, 8)


@contextmanager
def lazily_connected_gloo() -> Iterator[None]:
    """Gloo groups made inside the block connect lazily (`GLOO_LAZY_INIT`), unless the
    environment says otherwise already; the variable is as it was after the block."""
    before = os.environ.get(GLOO_LAZY_INIT)
    if before is None:
        os.environ[GLOO_LAZY_INIT] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_LAZY_INIT, None)


def set_transformer_fastpath(enabled: bool) -> bool:
    """Allow or forbid torch's fused transformer inference path (process-wide); what it was."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    return before


def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bf16 arithmetic units (AVX512-BF16 or AMX)."""
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if avx512_bf16 is not None and amx is not None:
        return bool(avx512_bf16() or amx())
    # torch 2.4 has no probe: the kernel lists the same CPU flags (Linux; elsewhere, none).
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set(re.findall(r"[\w.]+", cpuinfo))
    return bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
