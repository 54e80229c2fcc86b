"""Tensor parallelism: each block's matmuls split over the ranks of the mesh's `tp` dimension.

A plan names modules (dotted names, `*` standing for one part: `layers.*.mlp.up_proj`) and the
style each is split in:

- `colwise`: a Linear split by its output features (each rank computes some of them: the
  attention's query, key and value heads, the MLP's gate and up projections); its input whole
  on every rank, its output the rank's part;
- `rowwise`: a Linear split by its input features, fed a `colwise` one's part (attention's
  output projection, the MLP's down projection); the ranks' partial outputs are summed;
- `embedding`: an Embedding split by vocabulary rows, each rank looking up its rows; the
  output summed, whole on every rank;
- `head`: the output Linear split by vocabulary rows, its logits left split over the
  vocabulary (a DTensor, `Shard(-1)`): the loss is computed on the parts (`loss_parallel`,
  which the session enters around forward, loss and backward), so a 128k-vocabulary logit
  tensor is never whole on a rank;
- `norm`: a norm run on the rank's part of the sequence (sequence parallel).

Sequence parallel, where the plan names norms (every transformers plan does): between the
blocks' matmuls the activations are split along the sequence (dimension 1), so the norms,
the residual stream and their activation memory fall by the degree as well. Then a `rowwise`
Linear's sum arrives split along the sequence (a reduce-scatter instead of an all-reduce),
the module that holds one (the attention, the MLP) gathers the sequence on entry, the first
block splits it, and the head gathers it. The embedding's output stays whole, so a model's
own code above the blocks (positions, masks) sees the whole sequence.

`check_plan` refuses, in one line, a plan naming no module of the model, a style it does not
know, a module of the wrong kind for its style, or a split of features that does not divide
(the size a `colwise` or `rowwise` Linear splits, and the plan's own counts: attention and
key/value heads). A vocabulary may split unevenly (torch.chunk's sizes; exact, tested). Weights are split
from every rank's own copy (`src_data_rank=None`: no scatter), which the session made equal.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ddp_amp.errors import UsageError
from ddp_amp.torch_api import (ColwiseParallel, DTensor, Replicate, RowwiseParallel, SequenceParallel, Shard,
                               parallelize_module)

STYLES = ("colwise", "rowwise", "embedding", "head", "norm")
# What each style splits, by the module it applies to: (kind, attribute that must divide).
_SPLITS: dict[str, tuple[type[nn.Module], str]] = {
    "colwise": (nn.Linear, "out_features"), "rowwise": (nn.Linear, "in_features"),
    "embedding": (nn.Embedding, "num_embeddings"), "head": (nn.Linear, "out_features")}


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a model's modules are split over the tensor-parallel ranks."""

    styles: Mapping[str, str]
    """Module name pattern -> style (STYLES)."""
    divisible: Mapping[str, int] = field(default_factory=dict)
    """Counts the degree must divide besides the modules' sizes: {"num_key_value_heads": 8}."""
    source: str = "the plan"
    """Where the plan comes from, for refusals: "LlamaForCausalLM's tp_plan", "Task.tensor_parallel_plan"."""

    @property
    def sequence_parallel(self) -> bool:
        """Whether the activations between the matmuls are split along the sequence."""
        return "norm" in self.styles.values()


def matched(model: nn.Module, plan: TensorParallelPlan) -> dict[str, str]:
    """Each module of `model` the plan names, with its style (the first pattern that matches)."""
    found: dict[str, str] = {}
    for name, _ in model.named_modules():
        for pattern, style in plan.styles.items():
            if name and _matches(name, pattern):
                found[name] = style
                break
    return found


def _matches(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted))


def check_plan(model: nn.Module, plan: TensorParallelPlan, degree: int, flag: str = "--tensor-parallel") -> None:
    """A one-line UsageError where `plan` cannot split `model` over `degree` ranks; the model may
    be on the meta device (only names, kinds and sizes are read)."""
    unknown = sorted({style for style in plan.styles.values() if style not in STYLES})
    if unknown:
        raise UsageError(f"{plan.source}'s style", unknown[0], "one of " + ", ".join(STYLES),
                         "colwise and rowwise split a Linear by output and input features")
    for name, count in plan.divisible.items():
        if count % degree:
            raise UsageError(flag, degree, f"a degree that divides the model's {name} ({count})",
                             f"each rank computes {name} / {flag}; pick a divisor of {count}")
    found = matched(model, plan)
    if not any(style in ("colwise", "rowwise") for style in found.values()):
        raise UsageError(flag, degree, f"a plan that names modules of {type(model).__name__} to split",
                         f"{plan.source} matches no Linear of the model (its patterns: "
                         f"{', '.join(list(plan.styles)[:3])}); name the model's own modules")
    for name, style in found.items():
        module = model.get_submodule(name)
        if style == "norm":
            continue
        kind, size = _SPLITS[style]
        if not isinstance(module, kind):
            raise UsageError(f"{plan.source} for {name}", style, f"a {kind.__name__} for {style}",
                             f"{name} is a {type(module).__name__}; name the {kind.__name__} inside it")
        # A vocabulary splits unevenly as torch.chunk does (a 50,257-word one too); features must
        # split evenly, whole heads to each rank.
        if style not in ("embedding", "head") and getattr(module, size) % degree:
            raise UsageError(flag, degree, f"a degree that divides {name}.{size} ({getattr(module, size)})",
                             f"{style} splits {size} over the ranks; pick a divisor of it")


def split_dims(model: nn.Module, plan: TensorParallelPlan) -> dict[str, int | None]:
    """Each parameter of `model` (under every name it has), and the dimension the plan splits it
    along: 0 for a `colwise` Linear's weight and bias, an `embedding` or a `head`; 1 for a
    `rowwise` weight; None for what every rank holds whole (a `rowwise` bias, a norm, what the
    plan does not name). A model on the meta device will do."""
    styles = matched(model, plan)
    dims: dict[str, int | None] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        module, _, attribute = name.rpartition(".")
        style = styles.get(module)
        if style in ("colwise", "embedding", "head"):
            dims[name] = 0
        elif style == "rowwise" and attribute == "weight":
            dims[name] = 1
        else:
            dims[name] = None
    return dims


def apply_tensor_parallel(model: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh,
                          blocks: list[nn.Module]) -> nn.Module:
    """Split `model` in place over the 1-d `mesh` as `plan` says (collective where DTensors are
    made); `blocks`: its blocks in order (the first splits the sequence under sequence parallel).
    Tied parameters (an embedding shared by the head) stay one parameter."""
    found = matched(model, plan)
    sequence = plan.sequence_parallel
    tied = _tied_names(model)
    styles: dict[str, Any] = {}
    for name, style in found.items():
        styles[name] = _style(style, sequence)
    for style in styles.values():
        style.src_data_rank = None  # every rank holds the same weights: each keeps its part, no scatter
    parallelize_module(model, mesh, styles)
    _retie(model, tied)
    if sequence:
        holders = {name.rpartition(".")[0] for name, style in found.items() if style == "rowwise"}
        for name in sorted(holders):
            if name:
                model.get_submodule(name).register_forward_pre_hook(_gather_sequence(mesh), with_kwargs=True)
        if blocks:
            blocks[0].register_forward_pre_hook(_split_sequence(mesh), with_kwargs=True)
    return model


def _style(style: str, sequence: bool) -> Any:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel()
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "head":
        return ColwiseParallel(input_layouts=Shard(1) if sequence else Replicate(), output_layouts=Shard(-1),
                               use_local_output=False)
    return SequenceParallel()


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | int, Any] | None:
    """Where a module's activations come in: its first positional argument, else `hidden_states`."""
    if args and hasattr(args[0], "shape"):
        return 0, args[0]
    if "hidden_states" in kwargs:
        return "hidden_states", kwargs["hidden_states"]
    return None


def _replaced(args: tuple[Any, ...], kwargs: dict[str, Any], where: str | int,
              value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(where, int):
        return (value, *args[1:]), kwargs
    return args, {**kwargs, where: value}


def _gather_sequence(mesh: DeviceMesh) -> Any:
    """A pre-hook: the sequence part of this rank, as the whole sequence (a DTensor the
    `colwise` Linears inside take; its gradient is reduce-scattered back)."""
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        found = _first_tensor(args, kwargs)
        if found is None:
            return None
        value = found[1]  # a norm's DTensor, or a plain part
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, [Shard(1)], run_check=False)
        if value.placements != (Replicate(),):  # gathered once here, not by each Linear inside
            value = value.redistribute(mesh, [Replicate()])
        return _replaced(args, kwargs, found[0], value)
    return hook


def _split_sequence(mesh: DeviceMesh) -> Any:
    """A pre-hook: the whole sequence (the same on every rank), as this rank's part of it; the
    sequence must split evenly (torch's sequence-parallel styles count a part as 1/N of it)."""
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        found = _first_tensor(args, kwargs)
        if found is None or isinstance(found[1], DTensor):
            return None
        length, degree = found[1].shape[1], mesh.size()
        if length % degree:
            raise UsageError("--tensor-parallel", degree, f"a degree that divides each sequence ({length} tokens): "
                             "sequence parallel splits it evenly", f"make the model's input a multiple of {degree} "
                             "tokens long (causal_lm: --task-opt max_length)")
        part = DTensor.from_local(found[1], mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return _replaced(args, kwargs, found[0], part.to_local())
    return hook


def _tied_names(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters registered under several names, as (module name, attribute) lists."""
    seen: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                seen.setdefault(id(param), []).append((module_name, name))
    return [names for names in seen.values() if len(names) > 1]


def _retie(model: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Where splitting gave each name of a tied parameter one of its own, they share the first again."""
    for names in tied:
        first_module, first_name = names[0]
        kept = getattr(model.get_submodule(first_module), first_name)
        for module_name, name in names[1:]:
            module = model.get_submodule(module_name)
            if getattr(module, name) is not kept:
                module.register_parameter(name, kept)
