"""A transformers model's attention routed to a function of ddp_amp's (context parallel's).

transformers calls each attention layer's kernel by the name in `config._attn_implementation`,
looked up in its attention interface; a name registered there with no mask function of its own
makes the model build no mask at all (the function masks by itself). The function gets the
layer's query, key and value, (batch, heads, sequence, head size), and the layer's keyword
arguments, the position ids among them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ddp_amp.errors import UsageError


def attends_through_interface(model: nn.Module) -> bool:
    """Whether `model` is a transformers model whose layers look their attention up by name."""
    return hasattr(getattr(model, "config", None), "_attn_implementation")


def use_attention(model: nn.Module, name: str, function: Callable[..., Any], flag: str, value: object) -> None:
    """Make every attention layer of `model` call `function`, registered as `name`; a one-line
    UsageError naming `flag` and its `value` for a model that does not look its attention up by name."""
    if not attends_through_interface(model):
        raise UsageError(flag, value, f"a transformers model, whose attention layers are routed through "
                         f"transformers' attention interface ({type(model).__name__} is not one)",
                         "the lm task's nn.MultiheadAttention is not split: use --task causal_lm")
    try:
        from transformers import AttentionInterface
    except ImportError as error:  # transformers before 4.48
        raise UsageError(flag, value, "transformers >= 4.48 (its AttentionInterface)",
                         "pip install -U transformers") from error
    AttentionInterface.register(name, function)
    model.config._attn_implementation = name  # type: ignore[union-attr]  # checked above
