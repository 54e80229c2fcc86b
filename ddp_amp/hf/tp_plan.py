"""A transformers model's tensor-parallel plan, in ddp_amp's styles (parallel/tensor_parallel.py).

transformers gives each decoder family a plan: its config's `base_model_tp_plan` (the
attention's q, k, v projections `colwise`, its output `rowwise`; the MLP's gate and up
`colwise`, down `rowwise`), and the model instance's `_tp_plan`, the same names under the
model's prefix plus the embedding (`embedding_rowwise`) and the LM head
(`colwise_gather_output`). Their names map onto ddp_amp's: `colwise`, `rowwise`, `embedding`,
and `head`, whose logits stay split over the vocabulary for the loss (transformers gathers
them; here the cross-entropy runs on the parts). Sequence parallel is added on the norms of
each block and the final norm, which the model's pipeline plan (`_pp_plan`) names. A style
transformers has and ddp_amp does not map (packed, MoE experts) is refused in one line, and
so is a model without a plan (GPT-2: its Conv1D layers have none).

The heads' counts must divide by the degree (each rank computes whole heads): the config's
`num_attention_heads` and `num_key_value_heads` come with the plan for that check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ddp_amp.errors import UsageError

# transformers' style names -> ddp_amp's
STYLE_NAMES = {"colwise": "colwise", "rowwise": "rowwise", "embedding_rowwise": "embedding",
               "colwise_gather_output": "head", "sequence_parallel": "norm"}
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class ModelPlan:
    """A model's own plan: module name patterns -> ddp_amp's styles, and the counts to divide."""

    styles: dict[str, str]
    divisible: dict[str, int] = field(default_factory=dict)
    source: str = ""


def _is_transformers_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "base_model_prefix") and hasattr(model, "_tp_plan")


def model_tensor_parallel_plan(model: nn.Module, flag: str = "--tensor-parallel") -> ModelPlan | None:
    """`model`'s own plan where it is a transformers model (None where it is not one); a
    one-line UsageError for a transformers model without one, or with a style not mapped."""
    if not _is_transformers_model(model):
        return None
    name = type(model).__name__
    plan: dict[str, str] = dict(getattr(model, "_tp_plan", None) or {})
    if not any(style in ("colwise", "rowwise") for style in plan.values()):
        raise UsageError(flag, name, "a transformers model with a tensor-parallel plan (base_model_tp_plan)",
                         f"{name} has none; give the task a tensor_parallel_plan of its own, or drop {flag}")
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLE_NAMES:
            raise UsageError(f"{name}'s tp_plan for {pattern}", style, "one of " + ", ".join(STYLE_NAMES),
                             f"ddp_amp does not split {style} layers; give a plan of your own, or drop {flag}")
        styles[pattern] = STYLE_NAMES[style]
    styles.update(_norms(model))
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    divisible = {count: int(getattr(config, count)) for count in HEAD_COUNTS if getattr(config, count, None)}
    return ModelPlan(styles, divisible, f"{name}'s tp_plan")


def _norms(model: nn.Module) -> dict[str, str]:
    """Sequence parallel's norms: each block's, and the final norm (the pipeline plan's)."""
    stages: dict[str, Any] = dict(getattr(model, "_pp_plan", None) or {})
    found: dict[str, str] = {}
    for stage in stages:
        module = model.get_submodule(stage) if stage else model
        if isinstance(module, nn.ModuleList) and len(module):
            for child_name, child in module[0].named_children():
                if _is_norm(child):
                    found[f"{stage}.*.{child_name}"] = "norm"
        elif _is_norm(module):
            found[stage] = "norm"
    return found


def _is_norm(module: nn.Module) -> bool:
    """A norm layer (LayerNorm, RMSNorm, LlamaRMSNorm, ...): by its class, holding no submodules."""
    return "Norm" in type(module).__name__ and not any(True for _ in module.children())
